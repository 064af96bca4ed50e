"""A model-parallel random stream so dropout is right under tensor and sequence parallelism.

Activations that are replicated over the tp group (hidden states without SP) must drop the same
elements on every tp rank, so they use the default generator, seeded identically on those ranks.
Activations that differ per tp rank (attention heads, sequence chunks under SP) must drop
independent elements, so they run inside `tracker.fork()`, which swaps in a generator seeded
with `seed + offset + tp_rank`. Recomputation restores the tracked state (see `recompute`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

_TP_SEED_OFFSET = 2718


class ModelParallelRNG:
    """The tp-rank-specific random stream of one process, forked into around dropout calls."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None

    def seed(self, seed: int, tp_rank: int) -> None:
        gen = torch.Generator().manual_seed(seed + _TP_SEED_OFFSET + tp_rank)
        self._state = gen.get_state()

    def get_state(self) -> torch.Tensor | None:
        return None if self._state is None else self._state.clone()

    def set_state(self, state: torch.Tensor | None) -> None:
        self._state = state

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body with the tracked CPU RNG state, then restore the default one."""
        if self._state is None:
            self.seed(0, 0)
        default = torch.get_rng_state()
        torch.set_rng_state(self._state)
        try:
            yield
        finally:
            self._state = torch.get_rng_state()
            torch.set_rng_state(default)


# One stream per process, like the default generator it complements.
tracker = ModelParallelRNG()


def recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """`torch.utils.checkpoint` that also replays the model-parallel RNG on recomputation."""
    saved = tracker.get_state()
    calls = [0]

    def run(*inner: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        current = tracker.get_state()
        tracker.set_state(saved)
        try:
            return fn(*inner)
        finally:
            tracker.set_state(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
