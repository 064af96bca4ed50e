"""`--data-parallel zero1` under expert parallelism: dense parameters' AdamW state
sharded over dp x cp, expert pieces' over the expert-data-parallel group, on 4 gloo ranks with
ep2 over dp4 (edp 2, so every expert piece's moments really are split over two ranks).

One spawn runs every job: the zero1 pretraining run (4 steps, checkpoints at 2 and 4), the
same layout under ddp, the zero1 run resumed from its step-2 checkpoint (`pretrain --resume`),
a probe (the zero1 job loaded from step 2 takes two `train_step`s and reports each rank's
parameters and optimizer state), and re-saves: the zero1 step-2 checkpoint loaded under ep4
(edp 1), tp2 x ep2 and no expert parallelism, all zero1, and the ddp one under ep2 zero1, each
saved again at once. The test then checks, against a single-process run of the same rows
(4 micro-batches of 2 rows, as each dp rank's one micro-batch holds; the load-balancing loss
is per micro-batch):

- losses and global gradient norms equal one process (1e-5 relative) and ddp;
- the final parameters equal one process's (1e-5), and after the probe's steps every rank's
  parameters (every replica, so the gathers over dp and edp reached each) equal the run's
  step-4 checkpoint bit for bit;
- each rank's optimizer state holds only its rows: dense ones of dp 4, expert pieces of edp 2;
- the resumed run repeats steps 3-4 bit for bit;
- the moments and weights of each re-saved checkpoint equal the source's exactly.

Slow: the same run launched by `tessera pretrain --nproc-per-node 4` follows one process, and
so do zero1 runs under tp2 x ep2 (sequence parallel, edp 2), pp2 x ep2 and ep2 x etp2.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tessera.core.checkpoint import CheckpointReader
from tessera.core.parallel.sharding import is_expert_param, shard_expert_tensor
from tessera.core.parallel.zero import ShardedOptimizer, row_range
from tessera.training.config import load_config
from tessera.training.loop import local_rows, plan_for_world, pretrain, setup, train_step
from tessera.training.moments import read_global_moments
from tessera.training.objectives import objective_for
from tessera.training.state import (
    latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from tests.distributed_helper import run_ranks
from tests.pretrain_helper import (
    TinyData,
    pretrain_argv,
    read_losses,
    rewind_run,
    tessera_command,
)

STEPS = 4
RTOL = 1e-5
EP2_ZERO1 = ("--dp", "4", "--ep", "2", "--data-parallel", "zero1", "--micro-batches", "1")
EP2_DDP = ("--dp", "4", "--ep", "2", "--data-parallel", "ddp", "--micro-batches", "1")
RESAVED = {  # name -> (flags, the run whose step-2 checkpoint is loaded)
    "ep4-zero1": (("--dp", "4", "--ep", "4", "--data-parallel", "zero1", "--micro-batches", "1"),
                  "zero1"),
    "tp2-ep2-zero1": (("--tp", "2", "--dp", "2", "--ep", "2", "--sequence-parallel",
                       "--data-parallel", "zero1", "--micro-batches", "1"), "zero1"),
    "dense-zero1": (("--dp", "4", "--data-parallel", "zero1", "--micro-batches", "1"), "zero1"),
    "ep2-zero1-from-ddp": (EP2_ZERO1, "ddp"),
}


def _argv(tiny: TinyData, run: Path, *flags: str) -> list[str]:
    return pretrain_argv(tiny, run, "--steps", str(STEPS), "--save-interval", "2",
                         "--eval-batches", "0", "--model-overrides",
                         f"vocab_size={tiny.vocab_size}", "num_layers=2",
                         "moe_aux_loss_coef=0.5", "moe_z_loss_coef=0.1", *flags,
                         model="mixtral-tiny")


def _probe(argv: list[str], source: str) -> dict[str, Any]:
    """Load `source` (a step-2 checkpoint) into the zero1 job, take steps 3 and 4, and report
    this rank's parameters, grad norms and, per parameter, its optimizer rows and sizes."""
    plan, device = plan_for_world(load_config(argv)[0])
    job = setup(plan, device)
    step = load_training_checkpoint(Path(source), job.stages, job.optimizer)["step"]
    train_ds, _ = objective_for(plan.model).datasets(plan)
    norms = []
    for s in range(step, step + 2):
        tokens, labels, extra = job.objective.split_batch(
            local_rows(train_ds, s, plan.data, job.groups, job.device))
        norms.append(train_step(job, s, tokens, labels, extra)["grad_norm"])
    assert isinstance(job.optimizer, ShardedOptimizer)
    g, model = job.groups, job.stages[0]
    names = {id(p): model.global_name(n) for n, p in model.named_parameters()}
    state = {}
    for shard in job.optimizer:
        name = names[id(shard.param)]
        moments = job.optimizer.state[shard.view]
        state[name] = (shard.start, shard.stop, shard.rows, moments["exp_avg"].numel(),
                       moments["exp_avg_sq"].numel(), shard.param.numel())
    params = {model.global_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"coords": (g.dp_rank, g.dp_size, g.ep_rank, g.edp_rank, g.edp_size),
            "norms": norms, "state": state, "params": params}


def _resave(argv: list[str], source: str) -> None:
    plan, device = plan_for_world(load_config(argv)[0])
    job = setup(plan, device)
    step = load_training_checkpoint(Path(source), job.stages, job.optimizer)["step"]
    save_training_checkpoint(plan.loop.output, job.stages, job.optimizer, step=step,
                             consumed_samples=0, config=dict(plan.record), tokenizer=None,
                             keep_last=0)


def _jobs(rank: int, world_size: int, tiny: TinyData, runs: dict[str, str]) -> dict[str, Any]:
    p = {k: Path(v) for k, v in runs.items()}
    pretrain(load_config(_argv(tiny, p["zero1"], *EP2_ZERO1))[0])
    pretrain(load_config(_argv(tiny, p["ddp"], *EP2_DDP))[0])
    if rank == 0:
        rewind_run(p["zero1"], p["resumed"], 2)
    dist.barrier()
    pretrain(load_config(_argv(tiny, p["resumed"], *EP2_ZERO1, "--resume"))[0])
    probe = _probe(_argv(tiny, p["probe"], *EP2_ZERO1),
                   str(p["zero1"] / "checkpoints" / "step-00000002"))
    for name, (flags, source) in RESAVED.items():
        _resave(_argv(tiny, p[name], *flags), str(p[source] / "checkpoints" / "step-00000002"))
    return probe


@pytest.fixture(scope="module")
def single(tiny: TinyData, tmp_path_factory, one_thread) -> Path:
    run = tmp_path_factory.mktemp("moe-zero1") / "single"
    pretrain(load_config(_argv(tiny, run, "--micro-batches", "4"))[0])
    return run


@pytest.fixture(scope="module")
def spawned(tiny: TinyData, tmp_path_factory, one_thread) -> tuple[dict[str, Path], list[dict]]:
    root = tmp_path_factory.mktemp("moe-zero1-ranks")
    runs = {n: root / n for n in ("zero1", "ddp", "resumed", "probe", *RESAVED)}
    probes = run_ranks(_jobs, 4, tiny, {k: str(v) for k, v in runs.items()}, timeout=600)
    return runs, probes


def _metric(run: Path, key: str) -> dict[int, float]:
    with open(run / "metrics.jsonl", encoding="utf-8") as fh:
        return {r["step"]: r[key] for r in map(json.loads, fh) if "step" in r}


def _relative(got: dict[int, float], want: dict[int, float]) -> float:
    assert sorted(got) == sorted(want), (got, want)
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in want)


def test_zero1_ep2_follows_one_process_and_ddp(single, spawned):
    runs, _ = spawned
    zero1, ddp = runs["zero1"], runs["ddp"]
    loss_rel = _relative(read_losses(zero1), read_losses(single))
    norm_rel = _relative(_metric(zero1, "grad_norm"), _metric(single, "grad_norm"))
    ddp_rel = _relative(read_losses(zero1), read_losses(ddp))
    assert loss_rel <= RTOL and norm_rel <= RTOL and ddp_rel <= RTOL, (loss_rel, norm_rel,
                                                                         ddp_rel)
    got, want = CheckpointReader(latest_checkpoint(zero1)), CheckpointReader(
        latest_checkpoint(single))
    assert got.manifest.layout.ep == 2 and sorted(got.names()) == sorted(want.names())
    param_diff = max((got.global_tensor(n) - want.global_tensor(n)).abs().max().item()
                     for n in want.names())
    assert param_diff <= 1e-5, param_diff
    print(f"zero1 ep2 edp2 vs one process: loss {loss_rel:.1e}, grad norm {norm_rel:.1e}, "
          f"params {param_diff:.1e}; vs ddp: loss {ddp_rel:.1e}")


def test_zero1_ep2_resumes_exactly(spawned):
    runs, _ = spawned
    got, want = read_losses(runs["resumed"]), read_losses(runs["zero1"])
    assert sorted(got) == list(range(3, STEPS + 1))
    assert got == {s: want[s] for s in got}
    names = sorted(p.name for p in (latest_checkpoint(runs["zero1"]) / "training")
                   .glob("optim-experts-*"))
    assert names == [f"optim-experts-ep{e:02d}-etp00-pp00-edp{d:02d}.safetensors"
                     for e in range(2) for d in range(2)]


def test_zero1_ep2_every_rank_holds_only_its_rows_and_gathers_the_rest(spawned):
    runs, probes = spawned
    step4 = CheckpointReader(runs["zero1"] / "checkpoints" / "step-00000004")
    norms = _metric(runs["zero1"], "grad_norm")
    for probe in probes:
        dp_rank, dp, ep_rank, edp_rank, edp = probe["coords"]
        assert (dp, edp) == (4, 2)
        assert probe["norms"] == [norms[3], norms[4]]
        for name, (start, stop, rows, avg, avg_sq, numel) in probe["state"].items():
            rank, size = (edp_rank, edp) if is_expert_param(name) else (dp_rank, dp)
            assert (start, stop) == row_range(rows, rank, size), name
            assert avg == avg_sq == (stop - start) * numel // rows, name
            assert avg < numel or rows == 1, name  # a shard, never the whole state
        for name, value in probe["params"].items():  # every replica got the gathered rows
            want = step4.global_tensor(name)
            if is_expert_param(name):  # this rank's piece (etp 1)
                want = shard_expert_tensor(name, want, step4.manifest.model, ep_rank, 2, 0, 1)
            assert torch.equal(value, want), (probe["coords"], name)
    expert = {n: s for n, s in probes[0]["state"].items() if is_expert_param(n)}
    assert expert, "no expert parameters in the optimizer"


def test_zero1_ep2_checkpoints_move_exactly_to_other_layouts(spawned):
    runs, _ = spawned
    for name, (_, source) in RESAVED.items():
        a = runs[source] / "checkpoints" / "step-00000002"
        b = latest_checkpoint(runs[name])
        assert b.name == "step-00000002", name
        ma, mb = read_global_moments(a), read_global_moments(b)
        assert ma.keys() == mb.keys() and any(is_expert_param(k.split("/", 1)[1]) for k in ma)
        for key in ma:
            assert torch.equal(ma[key], mb[key]), (name, key)
        ra, rb = CheckpointReader(a), CheckpointReader(b)
        for tensor in ra.names():
            assert torch.equal(ra.global_tensor(tensor), rb.global_tensor(tensor)), (name, tensor)


@pytest.mark.slow  # a launch of four fresh processes
def test_zero1_ep2_launched_by_nproc_per_node(tiny, single, tmp_path):
    """`tessera pretrain --ep 2 --data-parallel zero1 --nproc-per-node 4` (edp 2) follows the
    single-process curve."""
    run = tmp_path / "launched"
    argv = _argv(tiny, run, *EP2_ZERO1, "--nproc-per-node", "4")
    done = subprocess.run(tessera_command("pretrain", *argv), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    worst = _relative(read_losses(run), read_losses(single))
    assert worst <= RTOL, worst
    print(f"launched zero1 ep2: worst relative loss difference {worst:.1e}")


OTHER_LAYOUTS = {
    "tp2-ep2": ("--tp", "2", "--dp", "2", "--ep", "2", "--sequence-parallel",
                "--micro-batches", "2"),
    "pp2-ep2": ("--pp", "2", "--dp", "2", "--ep", "2", "--micro-batches", "2"),
    "ep2-etp2": ("--dp", "4", "--ep", "2", "--etp", "2", "--micro-batches", "1"),
}


def _train_all(rank: int, world_size: int, tiny: TinyData, runs: dict[str, str]) -> None:
    for name, flags in OTHER_LAYOUTS.items():
        pretrain(load_config(_argv(tiny, Path(runs[name]), *flags, "--data-parallel",
                                   "zero1"))[0])


@pytest.mark.slow  # another 4-rank spawn of three runs
def test_zero1_under_other_expert_layouts_follows_one_process(tiny, single, tmp_path):
    """Each dp rank's micro-batches hold 2 rows, as the single run's 4 micro-batches do."""
    runs = {name: tmp_path / name for name in OTHER_LAYOUTS}
    run_ranks(_train_all, 4, tiny, {k: str(v) for k, v in runs.items()}, timeout=900)
    for name, run in runs.items():
        worst = _relative(read_losses(run), read_losses(single))
        assert worst <= RTOL, (name, worst)
        print(f"zero1 {name}: worst relative loss difference {worst:.1e}")
