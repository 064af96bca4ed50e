"""LoRA tuning over a sharded frozen base on 4 gloo ranks: tp2 x dp2 with `--data-parallel fsdp`
(the base's weights are FSDP2 shards over dp) and with `zero1` gives the single-process run's
losses (8 steps, 1e-5 relative) and adapter; only the factors train, the base stays as loaded;
each resumed from its step-4 checkpoint (factor and moment rows gathered over dp, then cut
again) ends bit for bit as it did uninterrupted.

One spawn of 4 ranks runs both layouts in turn; the reference runs here, in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.core.checkpoint import CheckpointReader
from tessera.core.lora import is_lora_parameter
from tessera.core.lora_format import load_adapter
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.distributed_helper import run_ranks
from tests.unit.tuning.tuning_helper import random_base_and_tasks, tune_argv

LAYOUTS = {
    "tp2dp2-fsdp": ("--tp", "2", "--dp", "2", "--data-parallel", "fsdp"),
    "tp2dp2-zero1": ("--tp", "2", "--dp", "2", "--data-parallel", "zero1"),
}
RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict[str, Path]:
    return random_base_and_tasks(tmp_path_factory.mktemp("tuning-lora-sharded"))


def _argv(s: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return tune_argv(s["base"], out, s["train"], None, "--steps", "8", "--global-batch", "8",
                     "--micro-batches", "2", "--method", "lora", "--lora-rank", "4",
                     "--lora-alpha", "8", "--lora-targets", "all", "--lr", "1e-2",
                     "--save-interval", "4", "--keep-last", "5", *extra)


def _check_steps(argv: list[str], base: str) -> dict[str, bool]:
    """Two steps: only the factors get gradients; each base weight equals the checkpoint's
    (its dp shard, under fsdp). Returns, per layout kind, whether the base was sharded."""
    cfg, _ = load_config(argv)
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    g = t.job.groups
    reader = CheckpointReader(base)
    for step in range(2):
        tokens, labels = train_batch(t, inputs.train, step)
        train_step(t.job, step, tokens, labels)
    sharded = []
    for stage in t.job.stages:
        for name, p in stage.named_parameters():
            if is_lora_parameter(name):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                assert grad is not None and grad.abs().sum() > 0, name
                continue
            assert p.grad is None, name
            sharded.append(isinstance(p, DTensor))
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            expected = reader.shard(stage.global_name(name), g.tp_rank, g.tp_size)
            assert torch.equal(whole, expected), name
    return {"all_sharded": all(sharded), "none_sharded": not any(sharded)}


def _rank_body(rank: int, world_size: int, jobs: dict[str, list[str]], base: str) -> dict:
    out = {}
    for name, argv in jobs.items():
        checked = _check_steps(argv, base)
        out[name] = {"losses": tune(load_config(argv)[0])["losses"], **checked}
        resumed = [*argv, "--resume"]
        out_dir = Path(argv[argv.index("--output") + 1])
        resumed[resumed.index("--output") + 1] = str(out_dir.with_name(out_dir.name + "-resumed"))
        if rank == 0:  # the run as it was after its step-4 checkpoint
            step4 = out_dir / "checkpoints" / "step-00000004"
            shutil.copytree(step4, out_dir.with_name(out_dir.name + "-resumed") / "checkpoints"
                            / step4.name)
        dist.barrier()
        out[f"{name}-resumed"] = {"losses": tune(load_config(resumed)[0])["losses"]}
    return out


def test_lora_over_a_sharded_base_follows_one_process(setting):
    root = setting["root"]
    reference = tune(load_config(_argv(setting, root / "single"))[0])
    jobs = {name: _argv(setting, root / name, *flags) for name, flags in LAYOUTS.items()}
    results = run_ranks(_rank_body, 4, jobs, str(setting["base"]), timeout=600)
    assert all(r["tp2dp2-fsdp"]["all_sharded"] for r in results)  # FSDP2 shards the base too
    assert all(r["tp2dp2-zero1"]["none_sharded"] for r in results)
    _, want = load_adapter(root / "single" / "adapter")
    for name in LAYOUTS:
        for got in results:
            worst = max(abs(a - b) / abs(b)
                        for a, b in zip(got[name]["losses"], reference["losses"]))
            assert worst <= RTOL, (name, worst, got[name]["losses"], reference["losses"])
        _, adapter = load_adapter(root / name / "adapter")
        assert adapter.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(adapter[key], want[key], rtol=1e-4, atol=1e-5)
        assert results[0][f"{name}-resumed"]["losses"] == results[0][name]["losses"][4:]
        _, resumed = load_adapter(root / f"{name}-resumed" / "adapter")
        assert all(torch.equal(resumed[k], adapter[k]) for k in adapter), name
