"""Bad training steps: updates skipped on the device, and what a run does when they persist.

A step whose loss or global gradient norm is not finite applies no update (`step_unless_bad`):
the fused AdamW kernel is handed the step's verdict as its `found_inf` flag, so it leaves the
weights, moments and step count alone without the host reading anything. The run's step
counter still advances (the learning-rate schedule and the data move on), and the step's
`bad_step` flag stays on the device until the next logging step reads its window.

`BadStepMonitor` judges the resolved window there, so the policy acts at logging-step
granularity (at most `--log-interval` steps after the fact): K consecutive bad steps, or a loss
over `--loss-spike-factor` times the mean of the last `--loss-spike-window` good steps' losses,
stops the run (`stop`), rolls it back to its last checkpoint and skips the batches trained on
since (`rollback`), or is only logged (`skip`). Skipped batches are `DataWindows`: the loop
maps step -> batch through them, and checkpoints keep them, so a resumed run skips them too.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tessera.core.config import ConfigError

BAD_STEP_POLICIES = ("stop", "rollback", "skip")

# Test hook: the global batch (0-based; step N trains on batch N-1 unless data was skipped)
# whose gradients become NaN after the backward, standing in for bad data. Read once.
TEST_NAN_BATCH_ENV = "TESSERA_TEST_NAN_BATCH"
TEST_NAN_BATCH: int | None = (int(os.environ[TEST_NAN_BATCH_ENV])
                              if os.environ.get(TEST_NAN_BATCH_ENV) else None)


def poison_gradients(models: Iterable[nn.Module]) -> None:
    """Fill one gradient with NaN (the test hook `TEST_NAN_BATCH`)."""
    for model in models:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
                return


def step_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """A 0-d bool device tensor: whether the step's loss and gradient norm are both finite."""
    return torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))


def step_unless_bad(optimizer: Any, ok: torch.Tensor) -> None:
    """`optimizer.step()` when `ok`, else nothing: no weight, moment or step-count change.

    Fused AdamW (what `optim.build_optimizer` builds on CPU and CUDA, also inside the ZeRO
    wrapper) decides on the device through its `found_inf` input, as `torch.amp.GradScaler`
    drives it. Any other optimizer reads `ok` on the host: one wait per step.
    """
    inner = getattr(optimizer, "inner", optimizer)  # core.parallel.zero.ShardedOptimizer
    fused = getattr(inner, "_step_supports_amp_scaling", False) and \
        getattr(inner, "defaults", {}).get("fused")
    if not fused:
        if bool(ok):
            optimizer.step()
        return
    inner.found_inf = (~ok).float()
    try:
        optimizer.step()
    finally:
        del inner.found_inf


@dataclass
class DataWindows:
    """Global batches a run never trains on, as disjoint `[start, stop)` ranges of batch
    indices (the batch a run without skips would train on at step N is N-1)."""

    windows: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> DataWindows:
        """From `--skip-data-steps` items `A-B`: the batches of steps A..B (1-based,
        inclusive, numbered as in a run that skips nothing)."""
        out = cls()
        for spec in specs:
            first, sep, last = str(spec).partition("-")
            try:
                a, b = int(first), int(last)
            except ValueError:
                a = b = 0
            if not sep or a < 1 or b < a:
                raise ConfigError(f"--skip-data-steps takes ranges of steps like 120-160 "
                                  f"(first-last, from 1); got {spec!r}")
            out.skip(a - 1, b)
        return out

    @classmethod
    def from_record(cls, record: Iterable[Iterable[int]] | None) -> DataWindows:
        out = cls()
        for start, stop in record or ():
            out.skip(int(start), int(stop))
        return out

    def record(self) -> list[list[int]]:
        """The windows as a checkpoint's manifest keeps them."""
        return [[a, b] for a, b in self.windows]

    def skip(self, start: int, stop: int) -> None:
        """Never train on batches `start` to `stop - 1` (merged with the windows already
        skipped)."""
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.windows, (start, stop)]):
            if merged and a <= merged[-1][1]:  # overlapping or adjacent: one window
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        self.windows = merged

    def merge(self, other: DataWindows) -> None:
        """Also skip every window of `other`."""
        for start, stop in other.windows:
            self.skip(start, stop)

    def batch(self, step: int) -> int:
        """The batch index step index `step` (0-based) trains on: the step-th batch that no
        window skips."""
        index = step
        for a, b in self.windows:  # sorted: each shift can move the index past later starts
            if index >= a:
                index += b - a
        return index


def check_policy(policy: str, *, rollback: bool = True) -> None:
    """`ConfigError` unless `policy` is a bad-step policy (`rollback`: one this loop has)."""
    allowed = BAD_STEP_POLICIES if rollback else tuple(p for p in BAD_STEP_POLICIES
                                                       if p != "rollback")
    if policy not in allowed:
        raise ConfigError(f"--bad-step-policy must be one of {', '.join(allowed)} here; "
                          f"got {policy!r}")


@dataclass(frozen=True)
class Verdict:
    """The policy's call on a window: act at `step` (1-based) because of `reason`."""

    step: int
    reason: str


class BadStepMonitor:
    """Reads a resolved window's `bad_step` flags and losses (the rows of `StepWindow`) and
    applies the bad-step policy (see the module docstring)."""

    def __init__(self, policy: str, max_bad_steps: int, spike_factor: float,
                 spike_window: int) -> None:
        check_policy(policy)
        self.policy, self.max_bad, self.spike_factor = policy, max_bad_steps, spike_factor
        self.skipped = 0  # updates skipped by this process (rolled-back steps included)
        self.consecutive = 0
        self.recent: deque[float] = deque(maxlen=spike_window)

    def reset(self) -> None:
        """Forget the streak and the loss history (after a rollback)."""
        self.consecutive = 0
        self.recent.clear()

    def check(self, rows: list[dict[str, Any]]) -> Verdict | None:
        """The first step of the window where the policy acts (None: none). Each row's
        `bad_step` flag becomes a bool and the row gains `skipped_steps`, the count so far.
        Under `stop` a verdict raises FloatingPointError naming the step instead."""
        verdict = None
        for row in rows:
            bad = bool(row.get("bad_step", 0.0)) or not math.isfinite(row["loss"])
            row["bad_step"] = bad
            self.skipped += bad
            self.consecutive = self.consecutive + 1 if bad else 0
            row["skipped_steps"] = self.skipped
            reason = None
            if bad and self.consecutive >= self.max_bad:
                reason = (f"{self.consecutive} consecutive steps had a non-finite loss or "
                          f"gradient norm (loss {row['loss']}, grad norm {row['grad_norm']}); "
                          "their updates were skipped")
            elif not bad:
                mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
                if (self.spike_factor and len(self.recent) == self.recent.maxlen
                        and row["loss"] > self.spike_factor * mean):
                    reason = (f"the loss spiked to {row['loss']:.4f}, over {self.spike_factor:g}"
                              f" x the mean {mean:.4f} of the last {len(self.recent)} steps")
                self.recent.append(row["loss"])
            if reason is not None and verdict is None:
                verdict = Verdict(row["step"], reason)
        if verdict is not None and self.policy == "stop":
            raise FloatingPointError(
                f"step {verdict.step}: {verdict.reason}; the run stops (--bad-step-policy "
                "stop). Lower --lr, use --precision fp32, or choose --bad-step-policy rollback")
        return verdict
