"""Shared fixtures for the tuning tests: one tiny pretrained base per session, and task data.

The base is pretrained once (a few seconds on a CPU) by the real pretraining loop on the synthetic
corpus of `tuning_helper`; every test that needs a base shares it, read-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.tuning.tuning_helper import make_base, task_examples, write_jsonl


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One thread: a tiny model runs no slower, and much faster on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a tiny Llama pretrained for 150 steps (with its tokenizer), with the
    compiled kernels of a default run (the acceptance thresholds were set on this base)."""
    from tessera.core import fused

    fused.set_mode("auto")
    try:
        return make_base(tmp_path_factory.mktemp("tuning-base"), steps=150)
    finally:
        fused.set_mode(None)


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """JSONL files: `kind` train/valid, `count` train/valid, and both tasks mixed."""
    root = tmp_path_factory.mktemp("tuning-data")
    kind_train, count_train = task_examples("kind", "train", 160), task_examples("count", "train", 160)
    kind_valid, count_valid = task_examples("kind", "valid", 48), task_examples("count", "valid", 48)
    mixed = [row for pair in zip(kind_train, count_train) for row in pair]
    return {
        "kind_train": write_jsonl(root / "kind_train.jsonl", kind_train),
        "kind_valid": write_jsonl(root / "kind_valid.jsonl", kind_valid),
        "count_valid": write_jsonl(root / "count_valid.jsonl", count_valid),
        "both_train": write_jsonl(root / "both_train.jsonl", mixed),
        "both_valid": write_jsonl(root / "both_valid.jsonl", kind_valid + count_valid),
    }
