"""ZeRO-1 and FSDP2 in the pretraining loop, on gloo ranks: the loss curve of ddp, sharded
optimizer checkpoints that resume bit-exactly on their own layout, and that resume under another
flavour, dp, tp or pp from the same moments.

Two spawns (2 ranks, then 4) run every job in turn; rank 0 rewinds runs between jobs (a run as
of its step-4 checkpoint) so resumed jobs can follow in the same spawn. "Re-save" jobs load a
checkpoint into another layout and save it again at once: the global moments and weights
reassembled from both checkpoints must be identical, which shows the moments arrived intact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.core.checkpoint import CheckpointReader, read_manifest
from tessera.training.config import load_config
from tessera.training.loop import plan_for_world, pretrain, setup
from tessera.training.moments import read_global_moments
from tessera.training.state import (
    latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from tests.distributed_helper import run_ranks
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses, rewind_run

STEPS = 8
SAME = 1e-6  # the bar for "equal to ddp": relative loss difference over 8 steps


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded")


def _run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> None:
    """Rank body: ("train", argv) | ("rewind", run, to) | ("resave", argv, checkpoint)."""
    for kind, *args in jobs:
        if kind == "train":
            pretrain(load_config(args[0])[0])
        elif kind == "rewind":
            if rank == 0:
                rewind_run(Path(args[0]), Path(args[1]), 4)
            dist.barrier()
        else:
            argv, source = args
            plan, device = plan_for_world(load_config(argv)[0])
            job = setup(plan, device)
            record = load_training_checkpoint(Path(source), job.stages, job.optimizer)
            save_training_checkpoint(plan.loop.output, job.stages, job.optimizer,
                                     step=record["step"], consumed_samples=0,
                                     config=dict(plan.record), tokenizer=None, keep_last=0)


def _flags(flavour: str, *layout: str) -> tuple[str, ...]:
    return ("--data-parallel", flavour, *layout)


DP2 = {"ddp": _flags("ddp", "--dp", "2"), "zero1": _flags("zero1", "--dp", "2"),
       "fsdp": _flags("fsdp", "--dp", "2")}
# resumed job -> (flags, the run whose step-4 checkpoint it starts from)
DP2_RESUMED = {
    "zero1-from-zero1": (DP2["zero1"], "zero1"),
    "fsdp-from-fsdp": (DP2["fsdp"], "fsdp"),
    "fsdp-from-zero1": (DP2["fsdp"], "zero1"),
    "zero1-from-fsdp": (DP2["zero1"], "fsdp"),
    "ddp-from-zero1": (DP2["ddp"], "zero1"),
}


@pytest.fixture(scope="module")
def dp2(tiny: TinyData, root: Path) -> dict[str, Path]:
    runs = {name: root / name for name in [*DP2, *DP2_RESUMED]}
    jobs: list[tuple] = [("train", pretrain_argv(tiny, runs[n], *f)) for n, f in DP2.items()]
    for name, (flags, source) in DP2_RESUMED.items():
        jobs.append(("rewind", str(runs[source]), str(runs[name])))
        jobs.append(("train", pretrain_argv(tiny, runs[name], *flags, "--resume")))
    run_ranks(_run_jobs, 2, jobs, timeout=900)
    return runs


def _relative(got: dict[int, float], want: dict[int, float], steps: range) -> float:
    assert sorted(got) == list(steps), got
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


@pytest.mark.parametrize("flavour", ["zero1", "fsdp"])
def test_dp2_loss_curve_equals_ddp(dp2, flavour):
    want = read_losses(dp2["ddp"])
    assert _relative(read_losses(dp2[flavour]), want, range(1, STEPS + 1)) <= SAME
    ckpt = latest_checkpoint(dp2[flavour])
    record = read_manifest(ckpt).extra["training"]
    assert record["optimizer"] == {"format": 2, "data_parallel": flavour, "dp_files": 2}
    names = sorted(p.name for p in (ckpt / "training").glob("optim-*"))
    assert names == ["optim-tp00-pp00-dp00.safetensors", "optim-tp00-pp00-dp01.safetensors"]


@pytest.mark.parametrize("flavour", ["zero1", "fsdp"])
def test_dp2_resume_is_bit_exact_on_the_same_layout(dp2, flavour):
    got = read_losses(dp2[f"{flavour}-from-{flavour}"])
    want = read_losses(dp2[flavour])
    assert {s: got[s] for s in range(5, STEPS + 1)} == {s: want[s] for s in range(5, STEPS + 1)}
    a = read_global_moments(latest_checkpoint(dp2[f"{flavour}-from-{flavour}"]))
    b = read_global_moments(latest_checkpoint(dp2[flavour]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["fsdp-from-zero1", "zero1-from-fsdp", "ddp-from-zero1"])
def test_dp2_resume_across_flavours_follows_the_uninterrupted_run(dp2, name):
    source = DP2_RESUMED[name][1]
    assert _relative(read_losses(dp2[name]), read_losses(dp2[source]), range(5, STEPS + 1)) <= SAME


def _same_state(a: Path, b: Path) -> None:
    """Identical global moments and weights, whatever layouts the two were saved under."""
    ma, mb = read_global_moments(a), read_global_moments(b)
    assert ma.keys() == mb.keys() and len(ma) > 0
    for key in ma:
        assert torch.equal(ma[key], mb[key]), key
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    for name in ra.names():
        assert torch.equal(ra.global_tensor(name), rb.global_tensor(name)), name


LAYOUTS4 = {  # 4-rank jobs trained from scratch, compared with the ddp job of the same layout
    "tp2dp2-ddp": _flags("ddp", "--tp", "2", "--dp", "2"),
    "tp2dp2-zero1": _flags("zero1", "--tp", "2", "--dp", "2"),
    "tp2dp2-fsdp": _flags("fsdp", "--tp", "2", "--dp", "2"),
    "pp2dp2-ddp": _flags("ddp", "--pp", "2", "--dp", "2"),
    "pp2dp2-zero1": _flags("zero1", "--pp", "2", "--dp", "2"),
    "pp2dp2-fsdp": _flags("fsdp", "--pp", "2", "--dp", "2"),
}
# re-saved under a 4-rank layout -> (flags, the dp2 run whose step-4 checkpoint is loaded)
RESAVED4 = {
    "dp4-zero1-from-fsdp": (_flags("zero1", "--dp", "4"), "fsdp"),
    "tp2dp2-fsdp-from-zero1": (LAYOUTS4["tp2dp2-fsdp"], "zero1"),
    "pp2dp2-zero1-from-fsdp": (LAYOUTS4["pp2dp2-zero1"], "fsdp"),
    "tp2pp2-ddp-from-zero1": (_flags("ddp", "--tp", "2", "--pp", "2"), "zero1"),
}


@pytest.fixture(scope="module")
def four(tiny: TinyData, root: Path, dp2: dict[str, Path]) -> dict[str, Path]:
    runs = {name: root / name for name in [*LAYOUTS4, *RESAVED4, "dp4-zero1-resumed"]}
    jobs: list[tuple] = [("train", pretrain_argv(tiny, runs[n], *f)) for n, f in LAYOUTS4.items()]
    for name, (flags, source) in RESAVED4.items():
        step4 = dp2[source] / "checkpoints" / "step-00000004"
        jobs.append(("resave", pretrain_argv(tiny, runs[name], *flags), str(step4)))
    jobs.append(("rewind", str(dp2["zero1"]), str(runs["dp4-zero1-resumed"])))
    jobs.append(("train", pretrain_argv(tiny, runs["dp4-zero1-resumed"],
                                        *_flags("zero1", "--dp", "4"), "--resume")))
    run_ranks(_run_jobs, 4, jobs, timeout=1200)
    return runs


@pytest.mark.parametrize("layout", ["tp2dp2", "pp2dp2"])
@pytest.mark.parametrize("flavour", ["zero1", "fsdp"])
def test_tp_and_pp_loss_curve_equals_ddp(four, layout, flavour):
    want = read_losses(four[f"{layout}-ddp"])
    assert _relative(read_losses(four[f"{layout}-{flavour}"]), want, range(1, STEPS + 1)) <= SAME


@pytest.mark.parametrize("name", sorted(RESAVED4))
def test_moments_move_exactly_to_another_layout(four, dp2, name):
    source = dp2[RESAVED4[name][1]] / "checkpoints" / "step-00000004"
    resaved = latest_checkpoint(four[name])
    assert resaved.name == "step-00000004"
    _same_state(source, resaved)


def test_dp2_zero1_checkpoint_resumes_under_dp4(four, dp2):
    got, want = read_losses(four["dp4-zero1-resumed"]), read_losses(dp2["zero1"])
    assert _relative(got, want, range(5, STEPS + 1)) <= SAME
    names = sorted(p.name for p in (latest_checkpoint(four["dp4-zero1-resumed"]) / "training")
                   .glob("optim-*"))
    assert names == [f"optim-tp00-pp00-dp{d:02d}.safetensors" for d in range(4)]
