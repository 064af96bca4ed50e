"""`tessera pretrain --model mixtral-tiny`: one process, tp2 with sequence parallelism and pp2
(2 gloo ranks, one spawn running both jobs) follow the same loss curve, and metrics.jsonl holds
the same router metrics (aux and z losses, tokens per expert, dropped tokens) in every layout.
Router losses are weighted heavily, so their gradients matter to the curve. Routing is dropless:
under sequence parallelism capacity is decided per sequence chunk, so dropping differs from one
process by design (the model-level parity tests cover capacity under tp and pp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tests.distributed_helper import run_ranks
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses

STEPS = 4
RTOL = 1e-5
ROUTER = ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
          "moe_tokens_per_expert_cv", "moe_dropped_tokens")


def _argv(tiny: TinyData, run: Path, *flags: str) -> list[str]:
    return pretrain_argv(tiny, run, "--steps", str(STEPS), "--save-interval", "0",
                         "--eval-batches", "0", "--model-overrides",
                         f"vocab_size={tiny.vocab_size}", "num_layers=2",
                         "moe_aux_loss_coef=0.5", "moe_z_loss_coef=0.1", *flags,
                         model="mixtral-tiny")


def _jobs(rank: int, world_size: int, argvs: list[list[str]]) -> None:
    for argv in argvs:
        pretrain(load_config(argv)[0])


def _router_metrics(run: Path) -> dict[int, dict[str, float]]:
    with open(run / "metrics.jsonl", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    return {r["step"]: {k: r[k] for k in ROUTER} for r in records if "step" in r}


@pytest.fixture(scope="module")
def runs(tiny: TinyData, tmp_path_factory, one_thread) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-pretrain")
    runs = {name: root / name for name in ("single", "tp2-sp", "pp2")}
    pretrain(load_config(_argv(tiny, runs["single"]))[0])
    run_ranks(_jobs, 2, [_argv(tiny, runs["tp2-sp"], "--tp", "2", "--sequence-parallel", "true"),
                         _argv(tiny, runs["pp2"], "--pp", "2")], timeout=400)
    return runs


@pytest.mark.slow  # ~10 s; tests/distributed/test_moe_parallel.py covers the same layouts cheaply
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_parallel_moe_pretraining_matches_one_process(runs, layout):
    want, got = read_losses(runs["single"]), read_losses(runs[layout])
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) / want[s] for s in got)
    assert worst <= RTOL, (got, want)
    single, parallel = _router_metrics(runs["single"]), _router_metrics(runs[layout])
    for step, metrics in single.items():
        for key, value in metrics.items():
            assert parallel[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert all(m["moe_dropped_tokens"] == 0 for m in single.values())
    assert all(m["moe_aux_loss"] > 0 and m["moe_tokens_per_expert_max"] > 0
               for m in single.values())
