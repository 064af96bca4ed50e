"""Shared test setup: offline, few-threaded, seeded torch; `gpu` tests skipped without CUDA."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# No test downloads anything: make an accidental Hugging Face download fail fast instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Few threads: CPU results stay reproducible and spawned gloo ranks don't fight over 2 cores.
# Under pytest-xdist (`-n 2`) each worker takes one, so that two workers fill 2 cores, not 4.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# The suite runs the eager formulas: compiling the fused kernels costs seconds in every process
# that trains (each spawned rank too, and all of it again on a clean checkout's cold Inductor
# cache), and what the suite checks is parity between layouts, which eager shows as well.
# tests/unit/core/test_fused.py checks the compiled kernels against eager; tests that need them
# (or the default `auto` end to end) ask for the `compiled_kernels` fixture.
os.environ.setdefault("TESSERA_FUSED_KERNELS", "off")

GPU_DIR = Path(__file__).parent / "gpu"
# Their tests spawn ranks that fill the cores: under `pytest -n 2 --dist loadgroup` one worker
# runs them all in turn, beside the other worker's in-process tests, never two spawns at once.
SPAWNING_DIR = Path(__file__).parent / "distributed"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything under tests/gpu as `gpu`, and skip `gpu` tests when CUDA is absent; put
    everything under tests/distributed in one xdist group (inert without pytest-xdist)."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if GPU_DIR in item.path.parents:
            item.add_marker(pytest.mark.gpu)
        if SPAWNING_DIR in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("spawns-ranks"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hygiene():
    """Each test starts from the same seed and leaves no default dtype or process group behind."""
    torch.manual_seed(0)
    random.seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test inside its own empty directory, so relative outputs (runs/...) land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny models run no slower, much faster on a busy 2-core
    machine, and in-process results match those of single-threaded spawned ranks bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A 600-document corpus with its tokenizer and indexed dataset (`tests/pretrain_helper.py`),
    built once per session: tests only read it (pretraining caches its sample index beside it,
    keyed by the run's parameters)."""
    from tests.pretrain_helper import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def compiled_kernels():
    """The fused kernels in their default `auto` mode (compiled when training) for a module."""
    from tessera.core import fused

    fused.set_mode("auto")
    yield
    fused.set_mode(None)
