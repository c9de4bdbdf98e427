"""Shared fixtures: one tiny random checkpoint per session, CPU thread count, servers, the browser, and the `gpu`
marker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file, save_file

from music3serve import contract
from music3serve.tiny import write_tiny_checkpoint

# CI runs on 2 cores, often next to other jobs, and `make test` runs two test processes (pytest-xdist). The tiny
# models here are made of small ops where a second intra-op thread buys little, and a busy core turns OpenMP's
# spin-waits into seconds per call; so one thread unless OMP_NUM_THREADS asks otherwise (torch reads it itself), and
# one inter-op thread. Set in the environment, so that the stage-1 worker processes the split tests spawn run with
# one thread too.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:  # already set, or parallel work already ran in this process
    pass


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random MiniMax-Music3 checkpoint in the released diffusers layout, written once per session.

    Treat it as read-only; tests that damage a checkpoint copy it first (shutil.copytree)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "checkpoint", seed=0)


@pytest.fixture(scope="session")
def ending_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny checkpoint whose audio_end logit row is tripled, so songs end by themselves."""
    root = tmp_path_factory.mktemp("ending") / "checkpoint"
    shutil.copytree(tiny_dir, root)
    folder = root / "language_model"
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    tensors = load_file(folder / shard)
    tensors["lm_head.weight"][contract.AUDIO_END] *= 3
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    return root


@pytest.fixture(autouse=True)
def plain_hot_paths_afterwards():
    """Fusion (models/fusion.py) is process-wide: a test that turned it on (an engine on CUDA does) must not leave
    later tests running through compiled hot paths by accident. Fusion already on when the test began stays on: a
    module's engine, set up before its first test, keeps the hot paths it was built with for all of them (its prefills
    run them eagerly, beside graphs captured with them), and its fixture turns fusion off when the module is done."""
    from music3serve.models.fusion import disable_fusion, fusion_enabled

    already_on = fusion_enabled()
    yield
    if not already_on:
        disable_fusion()


@pytest.fixture(scope="session")
def serve_http():
    """A context manager running an ASGI app under uvicorn in a thread on a free local port; gives the base URL.
    send_buffer: the connections' SO_SNDBUF (small, so that a client that stops reading backs the server's sends up
    soon); other keyword arguments go to uvicorn.Config (say timeout_graceful_shutdown)."""

    @contextlib.contextmanager
    def serve(app, send_buffer: int | None = None, **config):
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if send_buffer is not None:  # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(("127.0.0.1", 0))
        config.setdefault("http", "h11")  # as `serve` runs it (uvicorn would take httptools where it is installed)
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off", **config))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()

    return serve


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    """An engine on the tiny checkpoint on the CPU, one per module (modules that need another define their own)."""
    from music3serve.serving.engine import Engine

    engine = Engine.from_pretrained(tiny_dir, device="cpu")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def base_url(engine, serve_http):
    """The HTTP API over the requesting module's `engine` fixture, served by uvicorn."""
    from music3serve.serving.api import create_app

    with serve_http(create_app(engine)) as url:
        yield url


@pytest.fixture
def client(base_url: str):
    """An HTTP client of `base_url` (60 s per request)."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        yield client


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required"]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium under Playwright; missing: a skip with the reason, a failure under CI. One per module, not
    per session: while sync Playwright runs, its event loop counts as running on this thread, so a later module's
    asyncio.run would fail."""
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        why = f"the browser tests need playwright (pip install -e '.[test]'): {exc}"
    if why is None and shutil.which(CHROMIUM) is None:
        why = f"the browser tests need Debian's chromium at {CHROMIUM} (apt-get install chromium)"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def late_copy():
    """A PDL producer for testing consumers: `late_copy(src, delay_ns)` launches a kernel that lets the next kernel
    start at once (gdc_launch_dependents) and copies src into a new tensor only after spinning delay_ns. A
    consumer launched with PDL that read before its gdc_wait would see zeros."""
    import triton
    import triton.language as tl

    from music3serve.kernels.pdl import uses_pdl

    if not uses_pdl(torch.device("cuda")):
        pytest.skip("needs programmatic dependent launch (CUDA capability 9.0+, Triton 3.4+)")

    @triton.jit
    def late_copy_kernel(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        end = tl.extra.cuda.globaltimer() + delay_ns
        while tl.extra.cuda.globaltimer() < end:
            pass
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    def launch(src: torch.Tensor, delay_ns: int = 100_000) -> torch.Tensor:
        src = src.contiguous()
        dst = torch.zeros_like(src)
        late_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), delay_ns, BLOCK=1024,
                                                             launch_pdl=True)
        return dst

    return launch


@pytest.fixture
def root_logger():
    """cli.main sets up logging; put the root logger back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
