"""One real uvicorn server for the end-to-end tests, in its own process on a free local port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2e-key"


def real_engine_available() -> bool:
    """The real engine, unless TESSERA_E2E_FAKE=1 asks for the fake one (e.g. to bisect a bug)."""
    if os.environ.get("TESSERA_E2E_FAKE") == "1":
        return False
    try:
        import tessera.serving.engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    host_port: str  # 127.0.0.1:PORT (tritonclient's form)
    process: subprocess.Popen
    real: bool  # the real LLMEngine (else the fake)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_checkpoint(directory: Path) -> Path:
    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint
    from tests.serving_helper import train_tiny_tokenizer

    train_tiny_tokenizer(directory)
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    return save_checkpoint(directory / "tiny", model, tokenizer=directory / "tokenizer.model")


def start_server(checkpoint: Path, *extra: str, timeout_s: float = 180.0) -> Server:
    real = real_engine_available()
    port = free_port()
    argv = [sys.executable, "-m", "tests.e2e.serve_tiny", "--checkpoint", str(checkpoint),
            "--port", str(port), "--api-key", API_KEY, *extra, *([] if real else ["--fake"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return Server(url, f"127.0.0.1:{port}", process, real)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not come up within {timeout_s} s")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=5)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serving-e2e"))


@pytest.fixture(scope="session")
def server(tiny_checkpoint):
    server = start_server(tiny_checkpoint, "--max-concurrency", "8", "--max-batch", "4")
    yield server
    stop_server(server)
