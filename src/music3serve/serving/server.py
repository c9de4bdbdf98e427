"""The uvicorn server that runs the HTTP API (serving/api.py): its shutdown, its log lines about cut responses, and
its limit on open files."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Sequence

import uvicorn

from .. import contract
from .access import Access
from .api import create_app
from .engine import Engine
from .http_guard import AcceptErrorsOncePerMinute, guarded_protocol
from .song_stream import CutResponses

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10  # on SIGINT/SIGTERM, songs still streaming get this long, then they are cancelled


class ForceQuitServer(uvicorn.Server):
    """uvicorn's server, except that a second Ctrl-C (its force quit) still cuts the responses left and shuts the
    app down, so the engine closes (uvicorn skips both and the event loop's teardown cancelled them instead, logging
    a traceback per open response and one for the app), and that Ctrl-C ends it in KeyboardInterrupt also where
    SIGINT was ignored (run)."""

    def run(self, sockets: list | None = None) -> None:
        """uvicorn re-raises the Ctrl-C it caught once the server is down; where the process started with SIGINT
        ignored (a script's background job) that did nothing and the server exited 0 like a clean stop: here it
        ends in KeyboardInterrupt all the same (the CLI's 130)."""
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        super().run(sockets)
        if ignored and signal.SIGINT in getattr(self, "_captured_signals", ()):
            raise KeyboardInterrupt

    async def shutdown(self, sockets: list | None = None) -> None:
        await super().shutdown(sockets)
        if not self.force_exit:
            return
        tasks = list(self.server_state.tasks)
        for task in tasks:
            task.cancel(msg="Task cancelled, graceful shutdown cut short by a second Ctrl-C")
        await asyncio.gather(*tasks, return_exceptions=True)
        done = getattr(self.lifespan, "shutdown_event", None)  # None: lifespan off, nothing to shut down
        if done is not None and not done.is_set():
            await self.lifespan.shutdown()


# Open files kept beside one connection per song held: the engine's own (weights, pipes, shared memory) and the
# connections of clients being answered or refused meanwhile. Of these, ENGINE_FILES are never given to connections.
FILES_RESERVE = 256
ENGINE_FILES = 128


def fit_open_files(engine: Engine) -> int | None:
    """Every song held keeps its client's connection, an open file, until it ends, and a server out of files
    accepts no one (clients wait unanswered while the event loop logs EMFILE in a loop). So where the soft limit on
    open files has no room for engine.max_songs connections beside FILES_RESERVE (systemd services get a soft
    1024), raise it to the hard one; where even that is short, hold fewer songs: past them a client gets 429.
    Returns the most connections to keep open (the limit less ENGINE_FILES), None where files are not limited."""
    try:
        import resource
    except ImportError:  # not Unix: no such limit
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = engine.max_songs + FILES_RESERVE
    if soft == resource.RLIM_INFINITY:
        return None
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft < needed:
        songs = max(1, soft - FILES_RESERVE)
        log.warning("too few open files allowed for the engine's songs: it holds fewer (raise the hard limit, "
                    "e.g. systemd LimitNOFILE or ulimit -Hn)", extra={"open_files": soft, "max_songs": songs})
        engine.max_songs = songs
    return max(1, soft - ENGINE_FILES)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "INFO",
          access: Access = Access(), served_model_names: Sequence[str] = contract.SERVED_MODEL_NAMES) -> None:
    """Run the API on uvicorn until interrupted (logging stays as the caller set it up); access: API keys, browser
    origins and Host names (docs/api.md); served_model_names: the `model` names requests may give."""
    max_connections = fit_open_files(engine)
    for name, kind in (("uvicorn.error", CutResponses), ("asyncio", AcceptErrorsOncePerMinute)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    app = create_app(engine, close_engine=True, access=access, served_model_names=served_model_names)
    if access.api_keys:
        log.info("API keys required on /v1/", extra={"keys": len(access.api_keys)})
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level.lower(),
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, http=guarded_protocol(max_connections))
    # Not uvicorn.run: it swallows the Ctrl-C that stopped the server, which then exited 0 like a clean stop.
    ForceQuitServer(config).run()
