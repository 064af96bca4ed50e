"""The slowest rank of each logging interval, from each rank's own work in its steps.

Collectives make every rank's wall time equal, so a slow rank shows only in the time it works
before waiting for the others: from the start of a step to its gradient sync (`StepClock`).
At logging steps the ranks gather that one number each (`slowest_rank`; the only collective
it adds, and only there). On CUDA the clock times the host's side of that work (data, Python,
kernel launches), not the kernels themselves.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# The printed line names the slowest rank when it worked this much longer than the fastest.
STRAGGLER_MARGIN = 0.2


class StepClock:
    """Seconds this rank worked before each step's gradient sync, summed until `take`."""

    def __init__(self) -> None:
        self.local_s = 0.0
        self._begun: float | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one step: from here to `synced` (or to the step's end if it never syncs)."""
        self._begun = time.perf_counter()
        try:
            yield
        finally:
            self.synced()

    def synced(self) -> None:
        """The step reached its gradient sync: its own work ends here."""
        if self._begun is not None:
            self.local_s += time.perf_counter() - self._begun
            self._begun = None

    def take(self) -> float:
        """The seconds summed since the last `take`."""
        local, self.local_s = self.local_s, 0.0
        return local


def slowest_rank(local_s: float, device: torch.device) -> dict[str, Any]:
    """Every rank's `local_s` gathered (collective: every rank of the initialized world calls
    it at the same steps): `slowest_rank`, `slowest_rank_s` and `fastest_rank_s`."""
    mine = torch.tensor([local_s], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    times = torch.cat(every).tolist()
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"slowest_rank": slowest, "slowest_rank_s": times[slowest],
            "fastest_rank_s": min(times)}


def straggler_note(row: dict[str, Any]) -> str:
    """' | slowest rank 1 (0.84 s vs 0.20 s)' when the slowest rank of a logged row worked
    more than `STRAGGLER_MARGIN` longer than the fastest, else ''."""
    slow, fast = row.get("slowest_rank_s"), row.get("fastest_rank_s")
    if slow is None or fast is None or slow <= fast * (1 + STRAGGLER_MARGIN):
        return ""
    return f" | slowest rank {row['slowest_rank']} ({slow:.2f} s vs {fast:.2f} s)"
