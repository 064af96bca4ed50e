"""Flags of `tessera plan` that contradict each other or do not apply to the mode asked for.

Refused before any planning with a `PlanError` naming the flags and what to use instead, so
that a flag is never silently ignored (a `--micro-batch` given to `--serve`, a
`--recompute-layers` beside `--recompute selective`).
"""

from __future__ import annotations

import argparse

from tessera.plan.errors import PlanError

# Flags that only planning training reads (dest name -> flag).
TRAINING_ONLY = {"global_batch": "--global-batch", "seq_len": "--seq-len", "tokens": "--tokens",
                 "virtual_stages": "--virtual-stages", "cp": "--cp", "ep": "--ep",
                 "etp": "--etp", "micro_batch": "--micro-batch",
                 "sequence_parallel": "--sequence-parallel", "recompute": "--recompute",
                 "recompute_layers": "--recompute-layers", "output": "--output",
                 "measure": "--measure", "nproc_per_node": "--nproc-per-node"}
# Flags that only `--serve` reads.
SERVING_ONLY = {"context": "--context", "concurrency": "--concurrency",
                "max_latency_ms": "--max-latency-ms", "min_throughput": "--min-throughput"}
_SERVING_INSTEAD = {"--seq-len": "--context", "--global-batch": "--concurrency"}


def _given(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    return [flag for dest, flag in flags.items() if getattr(args, dest, None) not in (None, False)]


def check_flags(args: argparse.Namespace) -> None:
    """Raise `PlanError` for flags that do not go together (see the module docstring)."""
    if args.calibrate:
        clash = [f for f, on in (("--serve", args.serve), ("--measure", args.measure),
                                 ("--output", args.output)) if on]
        if clash:
            raise PlanError(f"--calibrate only measures this machine and exits; run it alone, "
                            f"then plan with {' '.join(clash)}")
        return
    if args.device is not None:
        raise PlanError(f"--device {args.device} chooses what --calibrate measures: add "
                        "--calibrate, or drop --device (planning runs on no device)")
    if args.serve:
        wrong = _given(args, TRAINING_ONLY)
        if wrong:
            instead = [f"{f} -> {_SERVING_INSTEAD[f]}" for f in wrong if f in _SERVING_INSTEAD]
            raise PlanError(f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} for "
                            "planning training, not --serve (which chooses tp, pp and the "
                            "batch itself; fix tp/pp with --tp/--pp)"
                            + (f"; for serving use {', '.join(instead)}" if instead else ""))
        return
    wrong = _given(args, SERVING_ONLY)
    if wrong:
        raise PlanError(f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} for --serve "
                        "only: add --serve to plan inference, or drop "
                        f"{'it' if len(wrong) == 1 else 'them'} to plan training")
    if args.nproc_per_node is not None and not args.measure:
        raise PlanError(f"--nproc-per-node {args.nproc_per_node} sets the local ranks of "
                        "--measure; add --measure, or give the cluster with --gpus")
    if args.recompute_layers is not None:
        if args.recompute_layers < 0:
            raise PlanError(f"--recompute-layers must be >= 0 (layers per pipeline stage), got "
                            f"{args.recompute_layers}")
        if args.recompute not in (None, "full"):
            raise PlanError(f"--recompute-layers {args.recompute_layers} applies to --recompute "
                            f"full only (it recomputes the first N layers of each stage), not "
                            f"--recompute {args.recompute}: drop one of them")
    if args.sequence_parallel and args.tp == 1:
        raise PlanError("--sequence-parallel shards activations over the tensor-parallel group "
                        "and needs tp > 1, but --tp is 1: drop one of them")
    if args.virtual_stages and args.virtual_stages > 1 and args.pp == 1:
        raise PlanError(f"--virtual-stages {args.virtual_stages} interleaves pipeline stages and "
                        "needs pp > 1, but --pp is 1: drop one of them")


def check_recompute_layers(args: argparse.Namespace, num_layers: int) -> None:
    """`--recompute-layers` beyond the layers of a stage cannot mean anything: beyond the
    model's layers, or, with `--pp` fixed, beyond the layers of each of its stages."""
    n = args.recompute_layers
    if n is None:
        return
    if n > num_layers:
        raise PlanError(f"--recompute-layers {n} exceeds the model's "
                        f"{num_layers} layers (it counts layers per pipeline stage); leave it "
                        "out to recompute all of them")
    if args.pp and num_layers % args.pp == 0 and n > num_layers // args.pp:
        raise PlanError(f"--recompute-layers {n} exceeds the {num_layers // args.pp} layers of "
                        f"each of the --pp {args.pp} stages (it counts layers per stage); use "
                        f"at most {num_layers // args.pp}, or leave it out to recompute all")
