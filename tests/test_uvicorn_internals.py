"""The uvicorn and h11 internals that serving/http_guard.py and serving/server.py build on, checked by name.

pyproject allows a range of uvicorn and h11 versions, not one pin. The guarded protocol subclasses uvicorn's
H11Protocol and reads its attributes; the server subclasses uvicorn.Server. If a release in the range renames or
drops one of them, this file fails with the name, instead of the server breaking at its first connection.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

pytest.importorskip("uvicorn")

import h11  # noqa: E402 (after the skip)
import uvicorn  # noqa: E402
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

# H11Protocol methods that GuardedH11Protocol overrides (calling super()) or calls, with their parameters.
PROTOCOL_METHODS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "handle_events": [],
    "on_response_complete": [],
    "timeout_keep_alive_handler": [],
    "_unset_keepalive_if_required": [],
}
# Attributes it reads on a protocol that has a connection.
PROTOCOL_ATTRIBUTES = ["conn", "connections", "cycle", "transport", "loop", "client", "timeout_keep_alive",
                       "timeout_keep_alive_task"]
# uvicorn.Server methods that ForceQuitServer overrides, and the attributes its shutdown reads.
SERVER_METHODS = {"run": ["sockets"], "shutdown": ["sockets"]}
SERVER_ATTRIBUTES = ["force_exit", "server_state", "_captured_signals"]


async def no_app(scope, receive, send) -> None:
    raise AssertionError("never called")


class FakeTransport(asyncio.Transport):
    """A transport with the extra info uvicorn reads on connection_made."""

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def parameters(cls: type, name: str) -> list[str]:
    return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]


@pytest.mark.parametrize("cls, methods", [(H11Protocol, PROTOCOL_METHODS), (uvicorn.Server, SERVER_METHODS)],
                         ids=["H11Protocol", "Server"])
def test_the_methods_we_override_keep_their_names_and_parameters(cls, methods):
    for name, expected in methods.items():
        assert callable(getattr(cls, name, None)), f"uvicorn {uvicorn.__version__}: {cls.__name__}.{name} is gone"
        assert parameters(cls, name) == expected, f"uvicorn {uvicorn.__version__}: {cls.__name__}.{name} changed"


def test_a_connected_protocol_has_the_attributes_the_guard_reads():
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(no_app, log_config=None)
        config.load()
        protocol = H11Protocol(config, ServerState(), app_state={}, _loop=loop)
        protocol.connection_made(FakeTransport())
        missing = [name for name in PROTOCOL_ATTRIBUTES if not hasattr(protocol, name)]
        assert not missing, f"uvicorn {uvicorn.__version__}: H11Protocol lost {missing}"
        assert protocol in protocol.connections
        assert isinstance(protocol.conn, h11.Connection)
        assert protocol.cycle is None and isinstance(protocol.timeout_keep_alive, (int, float))
        protocol.connection_lost(None)
    finally:
        loop.close()


def test_the_server_has_the_attributes_its_forced_shutdown_reads():
    server = uvicorn.Server(uvicorn.Config(no_app, log_config=None))
    missing = [name for name in SERVER_ATTRIBUTES if not hasattr(server, name)]
    assert not missing, f"uvicorn {uvicorn.__version__}: Server lost {missing}"
    assert isinstance(server.server_state.tasks, set)
    server.config.load()
    lifespan = server.config.lifespan_class(server.config)  # what Server.run sets as server.lifespan
    assert isinstance(lifespan.shutdown_event, asyncio.Event) and inspect.iscoroutinefunction(lifespan.shutdown)


def test_h11_states_and_trailing_data_are_as_the_guard_reads_them():
    conn = h11.Connection(h11.SERVER)
    assert conn.their_state is h11.IDLE and conn.our_state is h11.IDLE
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    assert isinstance(conn.next_event(), h11.Request)
    assert conn.their_state is h11.SEND_BODY
    data, closed = conn.trailing_data
    assert (data, closed) == (b"ab", False)
