"""Prompt tuning on gloo ranks: tp2 x pp2, tp2 x dp2 (sequence parallel), tp4 (kv heads
replicated over tp ranks) and cp4 give the single-process run's losses, prompt table and validation
metrics; the base stays bit-identical on every rank; only prompt parameters get gradients,
identical over tp (and over dp and cp after averaging); and `tessera tune --nproc-per-node 2` launches
its own ranks.

One spawn of 4 ranks runs both layouts in turn; the references run here, in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.core.checkpoint import CheckpointReader
from tessera.core.prompt_table import read_prompt_table
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.distributed_helper import run_ranks
from tests.unit.tuning.tuning_helper import random_base_and_tasks, tune_argv

LAYOUTS = {
    "tp2pp2": ("--tp", "2", "--pp", "2", "--micro-batches", "2"),
    "tp2dp2": ("--tp", "2", "--dp", "2", "--sequence-parallel", "true"),
    "tp4": ("--tp", "4"),  # llama-tiny's 2 kv heads, each replicated on 2 tp ranks
    # Context parallel: 24-token rows in chunks of 3, so the 4 virtual tokens span two cp ranks.
    "cp4": ("--cp", "4"),
}
RAN = {"tp2pp2": (2, 2, 1, 1), "tp2dp2": (2, 1, 2, 1), "tp4": (4, 1, 1, 1),
       "cp4": (1, 1, 1, 4)}  # (tp, pp, dp, cp) of each job
RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict[str, Path]:
    """A random-weight tiny Llama with a tokenizer, and two tasks' train/valid files."""
    return random_base_and_tasks(tmp_path_factory.mktemp("tuning-parallel"))


def _argv(s: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return tune_argv(s["base"], out, s["train"], s["valid"], "--steps", "4", "--global-batch",
                     "8", "--micro-batches", "2", "--virtual-tokens", "4", "--method",
                     "p-tuning", *extra)


def _check_step(argv: list[str], base: str) -> None:
    """One step under this layout: grads only on prompts, equal over tp and dp; base intact."""
    cfg, _ = load_config(argv)
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    g = t.job.groups
    tokens, labels = train_batch(t, inputs.train, 0)
    train_step(t.job, 0, tokens, labels)
    reader = CheckpointReader(base)
    for stage in t.job.stages:
        for name, p in stage.named_parameters():
            if not name.startswith("embedding_hook."):
                assert p.grad is None, name
                expected = reader.shard(stage.global_name(name), g.tp_rank, g.tp_size)
                assert torch.equal(p, expected), name
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            for group, size in ((g.tp_group, g.tp_size), (g.dp_group, g.dp_size),
                                (g.cp_group, g.cp_size)):
                if group is None:
                    continue
                copies = [torch.empty_like(p.grad) for _ in range(size)]
                dist.all_gather(copies, p.grad.contiguous(), group=group)
                for c in copies:
                    torch.testing.assert_close(c, p.grad, rtol=0, atol=1e-7)


def _rank_body(rank: int, world_size: int, jobs: dict[str, list[str]], base: str) -> dict:
    out = {}
    for name, argv in jobs.items():
        _check_step(argv, base)
        summary = tune(load_config(argv)[0])
        out[name] = {"losses": summary["losses"], "after": summary["after"]}
    return out


@pytest.fixture(scope="module")
def reference(setting) -> dict:
    return tune(load_config(_argv(setting, setting["root"] / "single"))[0])


def test_layouts_match_one_process_and_keep_the_base(setting, reference):
    root = setting["root"]
    jobs = {name: _argv(setting, root / name, *flags) for name, flags in LAYOUTS.items()}
    results = run_ranks(_rank_body, 4, jobs, str(setting["base"]), timeout=600)
    _, want = read_prompt_table(root / "single")
    for name in LAYOUTS:
        for rank_result in results:
            got = rank_result[name]
            worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"]))
            assert worst <= RTOL, (name, got["losses"], reference["losses"])
            for task, metrics in reference["after"].items():
                assert got["after"][task]["accuracy"] == metrics["accuracy"], name
                assert abs(got["after"][task]["loss"] - metrics["loss"]) <= 1e-4 * metrics["loss"]
        ran = json.loads((root / name / "checkpoints" / "step-00000004" / "state.json")
                         .read_text())["config"]["parallel"]
        assert (ran["tp"], ran["pp"], ran["dp"], ran["cp"]) == RAN[name]
        _, table = read_prompt_table(root / name)
        for task in want:
            torch.testing.assert_close(table[task], want[task], rtol=1e-4, atol=1e-5)


def test_nproc_per_node_launches_tuning_ranks(setting, reference, tmp_path):
    argv = _argv(setting, tmp_path / "run", "--tp", "2", "--nproc-per-node", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tessera", "tune", *argv], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    _, want = read_prompt_table(setting["root"] / "single")
    _, got = read_prompt_table(tmp_path / "run")
    for task in want:
        torch.testing.assert_close(got[task], want[task], rtol=1e-4, atol=1e-5)
