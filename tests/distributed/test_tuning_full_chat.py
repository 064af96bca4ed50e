"""Full-parameter tuning on packed conversations over gloo ranks: tp2 x pp2 gives the
single-process run's losses (8 steps, 1e-5 relative) and tuned weights (OUTPUT/model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.core.checkpoint import CheckpointReader
from tessera.tuning.config import load_config
from tessera.tuning.loop import tune
from tests.distributed_helper import run_ranks
from tests.unit.tuning.tuning_helper import random_base_and_tasks, tune_argv

RTOL = 1e-5
WORDS = "red green blue small large box ball cube".split()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict[str, Path]:
    s = random_base_and_tasks(tmp_path_factory.mktemp("tuning-full"))
    rows = []
    for i in range(24):
        words = [WORDS[(i * k + 1) % len(WORDS)] for k in (1, 3, 5)]
        rows.append({"messages": [{"role": "user", "content": " ".join(words)},
                                  {"role": "assistant", "content": " ".join(reversed(words))}]})
    s["chat"] = s["root"] / "chat.jsonl"
    s["chat"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return s


def _argv(s: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return tune_argv(s["base"], out, s["chat"], None, "--method", "full", "--pack", "true",
                     "--steps", "8", "--global-batch", "4", "--micro-batches", "2",
                     "--lr", "1e-3", *extra)


def _rank_body(rank: int, world_size: int, argv: list[str]) -> list[float]:
    return tune(load_config(argv)[0])["losses"]


def test_tp2_pp2_follows_one_process(setting):
    root = setting["root"]
    reference = tune(load_config(_argv(setting, root / "single"))[0])["losses"]
    argv = _argv(setting, root / "tp2pp2", "--tp", "2", "--pp", "2")
    for losses in run_ranks(_rank_body, 4, argv, timeout=600):
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        assert len(losses) == 8 and worst <= RTOL, (worst, losses, reference)
    assert reference[-1] < reference[0]
    want, got = CheckpointReader(root / "single" / "model"), CheckpointReader(root / "tp2pp2" / "model")
    assert got.manifest.layout.tp == 2 and got.manifest.layout.pp == 2
    for name in want.manifest.weight_map:
        torch.testing.assert_close(got.global_tensor(name), want.global_tensor(name),
                                   rtol=1e-4, atol=1e-6)
