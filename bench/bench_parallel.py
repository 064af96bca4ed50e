"""Parallel overhead on gloo: step time of tp2, pp2 (each schedule) and dp2 against one process,
for the same model and global batch, every rank on one thread.

For pipelines, the measured bubble is `1 - ideal / measured`, where ideal is the one-process
step time divided by the pipeline size (perfect split, no communication); the theoretical bubble
of 1F1B-like schedules is `(p - 1) / (m + p - 1)` of the step, and interleaving over v chunks
divides the idle time by v. On CPU the measured value also carries gloo's communication time.
Each row is printed as it is measured; `--budget-s` stops starting layouts once spent.

    python bench/bench_parallel.py [--layers 8 --hidden 256 --seq 128 --batch 16 --steps 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.parallel.pipeline import split_layout_and_schedule  # noqa: E402
from tessera.core.parallel.spawn import run_ranks  # noqa: E402

LAYOUTS = [  # (label, Layout and TrainSchedule fields)
    ("tp2", dict(tp=2)),
    ("tp2 + sequence parallel", dict(tp=2, sequence_parallel=True)),
    ("pp2 1f1b", dict(pp=2, schedule="1f1b")),
    ("pp2 gpipe", dict(pp=2, schedule="gpipe")),
    ("pp2 interleaved-1f1b (v=2)", dict(pp=2, virtual_stages=2, schedule="interleaved-1f1b")),
    ("pp2 zero-bubble", dict(pp=2, schedule="zero-bubble")),
    ("pp2 zbv (v=2)", dict(pp=2, virtual_stages=2, schedule="zbv")),
    ("dp2", dict(dp=2)),
]


def _config(args) -> ModelConfig:
    return ModelConfig.from_name("llama-tiny", vocab_size=4096, hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=args.hidden // 32,
                                 num_kv_heads=args.hidden // 64, ffn_hidden_size=args.hidden * 3,
                                 max_position_embeddings=args.seq)


def _batch(args):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (args.batch, args.seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def single_step_time(args) -> float:
    torch.set_num_threads(1)
    model = build_model(_config(args)).train()
    tokens, labels = _batch(args)
    best = float("inf")
    for i in range(args.steps + 1):
        tic = time.perf_counter()
        for t, lab in zip(tokens.chunk(args.micro_batches), labels.chunk(args.micro_batches)):
            (model(t, lab) / args.micro_batches).backward()
        if i:
            best = min(best, time.perf_counter() - tic)
    return best


def _rank_body(rank: int, world: int, args, kwargs: dict) -> float:
    from tessera.core.parallel import pipeline
    from tessera.core.parallel.data_parallel import allreduce_gradients
    from tessera.core.parallel.groups import init_groups

    par, sched = split_layout_and_schedule(dict(micro_batches=args.micro_batches, **kwargs))
    groups = init_groups(par)
    config = _config(args)
    tokens, labels = _batch(args)
    if par.dp > 1:
        per = args.batch // par.dp
        tokens, labels = (x[groups.dp_rank * per:(groups.dp_rank + 1) * per]
                          for x in (tokens, labels))
    if par.pp > 1:
        stages = pipeline.build_stages(config, par, groups, schedule=sched)
        schedule = pipeline.build_schedule(stages, par, sched, groups,
                                           pipeline.pipeline_loss_fn(config, groups))
    else:
        stages = [build_model(config, par, groups)]
    n_mb = sched.micro_batches if par.pp == 1 else 1
    best = float("inf")
    for i in range(args.steps + 1):
        torch.distributed.barrier()
        tic = time.perf_counter()
        if par.pp > 1:
            pipeline.pipeline_step(schedule, stages, groups, tokens, labels)
        else:
            for t, lab in zip(tokens.chunk(n_mb), labels.chunk(n_mb)):
                (stages[0](t, lab) / n_mb).backward()
        pipeline.sync_sequence_parallel_grads(stages, groups)
        allreduce_gradients(stages, groups)
        torch.distributed.barrier()
        if i:
            best = min(best, time.perf_counter() - tic)
    return best


def theoretical_bubble(pp: int, m: int, v: int) -> float:
    idle = (pp - 1) / v
    return idle / (m + idle)


def run(args, rows: Rows) -> None:
    budget = Budget(args.budget_s)
    base = single_step_time(args)
    rows.add({"layout": "1 process (1 thread)", "step s": base, "vs 1 process": 1.0})
    for label, kwargs in LAYOUTS:
        if budget.skips(f"{label} and later layouts"):
            break
        par, _ = split_layout_and_schedule(dict(micro_batches=args.micro_batches, **kwargs))
        seconds = max(run_ranks(_rank_body, par.world_size, args, kwargs, timeout=600))
        row = {"layout": label, "step s": seconds, "vs 1 process": base / seconds}
        if par.pp > 1:
            row["bubble measured"] = max(0.0, 1 - base / par.pp / seconds)
            row["bubble theory"] = theoretical_bubble(par.pp, args.micro_batches,
                                                      par.virtual_stages)
        rows.add(row)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no layout starts once it is spent")
    args = parser.parse_args(argv)
    rows = Rows("parallel")
    run(args, rows)
    return rows.finish()


if __name__ == "__main__":
    main()
