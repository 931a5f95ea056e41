"""One launched app (``python app.py`` on the bundled model) shared by the app tests."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="session")
def app_url(tmp_path_factory) -> Iterator[str]:
    with launched_app([], tmp_path_factory.mktemp("app") / "app.log") as url:
        yield url


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM (requirements-gpu.txt); skipped elsewhere")
