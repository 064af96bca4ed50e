"""`plan_training`: the training search end to end (enumerate, estimate, keep what fits, rank)
and, when nothing fits, why: the fixed dimensions at fault (`diagnose`), or how short memory is
and what would fit (the fewest GPUs, or a card with more memory)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from tessera.plan import estimate as E
from tessera.plan.diagnose import fixed_alternatives
from tessera.plan.errors import PlanError
from tessera.plan.hardware import PROFILES
from tessera.plan.search import (
    RECOMPUTE,
    Candidate,
    Fixed,
    TrainingJob,
    _candidate,
    _check_job,
    _configs,
    _settle_recompute_layers,
)


def _rank_key(c: Candidate) -> tuple[float, float]:
    return (c.step_time_s, c.memory_gib)


def plan_training(job: TrainingJob, fixed: Fixed | None = None, top: int | None = None
                  ) -> list[Candidate]:
    """The configurations of `job` that fit, fastest first (`top` of them, all when None), with
    the dimensions `fixed` fixes (default: none).

    Raises `PlanError` when none fits, saying how short memory is and what would fit (the
    fewest GPUs, or a card with more memory, at the same batch)."""
    fixed = fixed or Fixed()
    _check_job(job)
    if fixed.recompute is not None and fixed.recompute not in RECOMPUTE:
        raise PlanError(f"unknown recompute {fixed.recompute!r}; choose one of {list(RECOMPUTE)}")
    fits: list[Candidate] = []
    smallest: tuple[float, E.Config] | None = None
    seen = 0
    cap = job.hardware.memory_gib
    too_big: dict[tuple[Any, ...], int] = {}  # layout -> smallest micro-batch that does not fit
    for c in _configs(job, fixed):
        key = (c.tp, c.pp, c.cp, c.ep, c.etp, c.virtual_stages, c.sequence_parallel,
               c.recompute)
        if c.micro_batch > too_big.get(key, c.micro_batch):
            continue  # memory grows with the micro-batch (micro-batches come in ascending order)
        c2 = _settle_recompute_layers(job, c, fixed)
        if c2 is None:
            continue
        seen += 1
        mem = E.memory(job._estimate, c2)
        if mem.total <= cap:  # only what fits is timed
            fits.append(_candidate(job, c2, mem))
            continue
        too_big[key] = min(too_big.get(key, c.micro_batch), c.micro_batch)
        if smallest is None or mem.total < smallest[0]:
            smallest = (mem.total, c2)
    if not fits:
        raise PlanError(_nothing_fits(job, fixed, seen,
                                      _candidate(job, smallest[1]) if smallest else None))
    fits.sort(key=_rank_key)
    return fits[:top] if top else fits


def _fits_somewhere(job: TrainingJob, fixed: Fixed) -> bool:
    ej = job._estimate
    for c in _configs(job, fixed, fit_only=True):
        if E.memory(ej, replace(c, recompute_layers=None)).total <= job.hardware.memory_gib:
            return True
    return False


def _fewest_gpus(job: TrainingJob, fixed: Fixed, most: int = 128) -> int | None:
    """About the fewest GPUs (up to `most` x as many, whole nodes beyond one) on which `job`
    fits: doubling until it fits, then bisecting the whole-node counts in between (assuming
    that what fits on n GPUs fits on more)."""
    node = job.gpus_per_node

    def whole(n: int) -> int:
        return n if n <= node else -(-n // node) * node

    def fits(n: int) -> bool:
        return _fits_somewhere(replace(job, gpus=n), fixed)

    lo, hi = job.gpus, None
    while whole(lo * 2) <= job.gpus * most:
        if fits(whole(lo * 2)):
            hi = whole(lo * 2)
            break
        lo = whole(lo * 2)
    if hi is None:
        return None
    while hi > node and hi - lo > node:  # bisect over whole nodes
        mid = whole((lo + hi) // 2 // node * node) if (lo + hi) // 2 > node else whole(hi // 2)
        if mid <= lo or mid >= hi:
            break
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _nothing_fits(job: TrainingJob, fixed: Fixed, seen: int, smallest: Candidate | None
                  ) -> str:
    hw = job.hardware
    if not seen:
        head = (f"no valid configuration of {job.model.name} on {job.gpus} GPUs with global "
                f"batch {job.global_batch} and sequence {job.seq_len}{_fixed_text(fixed)}")
        culprits = fixed_alternatives(job, fixed)
        if culprits:
            return head + ":\n  - " + "\n  - ".join(culprits)
        return (head + ": no tp x pp x cp x dp split satisfies the divisibility rules (check "
                "that the batch divides by the data-parallel sizes the GPU count leaves, and "
                "the fixed dimensions together)")
    msg = (f"{job.model.name} does not fit on {job.gpus} x {hw.name} ({hw.memory_gib:.1f} GiB) "
           f"with global batch {job.global_batch}{_fixed_text(fixed)}: the most frugal "
           f"configuration ({smallest.layout}, micro-batch {smallest.micro_batch}, recompute "
           f"{smallest.recompute}) needs {smallest.memory_gib:.1f} GiB per GPU "
           f"(weights {smallest.memory.weights:.1f}, optimizer {smallest.memory.optimizer:.1f}, "
           f"activations {smallest.memory.activations:.1f}).")
    hints = []
    fewest = _fewest_gpus(job, fixed)
    if fewest:
        hints.append(f"{fewest} x {hw.name} would fit")
    for other in sorted(PROFILES.values(), key=lambda p: p.memory_gib):
        if other.memory_gib > hw.memory_gib and job.precision in other.peak_tflops:
            if _fits_somewhere(replace(job, hardware=other), fixed):
                hints.append(f"{job.gpus} x {other.name} ({other.memory_gib:.0f} GiB) would fit")
                break
    if hints:
        msg += " What would fit: " + "; ".join(hints) + "."
    else:
        msg += " Neither more GPUs (up to 128x) nor a larger card fits it: shrink the model."
    return msg


def _fixed_text(fixed: Fixed) -> str:
    items = [f"{f.name}={getattr(fixed, f.name)}" for f in fields(fixed)
             if getattr(fixed, f.name) is not None]
    return f" (fixed: {', '.join(items)})" if items else ""
