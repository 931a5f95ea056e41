"""One launched app (``python app.py`` on the bundled model) shared by the app tests; Triton's interpreter for the
kernel tests on a machine without a GPU; the ``slow`` and ``gpu`` markers."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

INTERPRET = "TRITON_INTERPRET"
# Triton makes a kernel compiled or interpreted when its @jit decorates it, as a test module imports it: without a
# GPU the kernels must be decorated for the interpreter, so it is on before any test module is collected.
INTERPRETING = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
if INTERPRETING:
    os.environ[INTERPRET] = "1"

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_THREADS = torch.get_num_threads()
STARTUP_TIMEOUT_S = 300  # model load is ~20 s on an idle 2-core machine; leave room for a busy one


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def launched_app(args: list[str], log_path: Path) -> Iterator[str]:
    """``python app.py ARGS`` on a free port, until it answers; yields its URL and stops it after."""
    port = free_port()
    env = os.environ | {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--host", "127.0.0.1", "--port", str(port), *args],
                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"app.py exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"app.py did not answer within {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def busy_core() -> Iterator[None]:
    """A process that keeps one core busy, as a machine doing something else does, until the block ends."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running before what it is to disturb begins
        yield
    finally:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def app_url(tmp_path_factory) -> Iterator[str]:
    with launched_app([], tmp_path_factory.mktemp("app") / "app.log") as url:
        yield url


@pytest.fixture(scope="session")
def bundled_decoder():
    """The bundled SmolLM2 and the shipped drafter as ``python app.py`` loads them (about 20 s), loaded once for
    every test that needs the real pair: decoders share models, never a run's state."""
    from engine.loop.loading import load_decoder

    return load_decoder()


@pytest.fixture(scope="session")
def launched_threads() -> int:
    """Intra-op threads of what the tests launch (the app, the bench): torch's default, which ``one_thread``
    leaves to them."""
    return DEFAULT_THREADS


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The models the tests run in their own process are tiny or small: intra-op threads gain them nothing, and on
    a shared 2-core machine a descheduled worker stalls every small op for tens of milliseconds."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture(autouse=True, scope="session")
def no_interpreter_outside_kernel_tests():
    """The engine takes its Triton paths wherever the interpreter is on (``triton_runs_on``). Outside the kernel
    tests it picks them as a CPU install does, the app the tests launch too: the interpreter would take seconds
    for each tree a decoding step builds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(INTERPRET, raising=False)
        yield


@pytest.fixture(autouse=True)
def interpreter_in_kernel_tests(request, monkeypatch):
    if INTERPRETING and request.node.get_closest_marker("triton"):
        monkeypatch.setenv(INTERPRET, "1")


def pytest_collection_modifyitems(items):
    for item in items:
        # the launched app: ~25 s to start, seconds a request on 2 cores; a browser's page of it; the bundled pair
        if {"app_url", "browser", "bundled_decoder"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM (requirements-gpu.txt); skipped elsewhere")
    config.addinivalue_line("markers", "triton: runs Triton kernels (without a GPU under Triton's interpreter)")
    config.addinivalue_line("markers", "slow: takes long on 2 CPU cores; `pytest -m \"not slow\"` leaves it out")
