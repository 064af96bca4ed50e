"""The per-rank work clock and the straggler note of the logged line (the gathered slowest
rank of a launched job is tests/distributed/test_hangs.py)."""

from __future__ import annotations

import itertools

from tessera.training import stragglers
from tessera.training.stragglers import StepClock, straggler_note


def test_the_clock_counts_each_step_up_to_its_sync(monkeypatch):
    ticks = itertools.count(0.0, 1.0)  # every reading is one second after the last
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: next(ticks))
    clock = StepClock()
    with clock.step():  # begins at 0
        clock.synced()  # 1: one second of own work
        clock.synced()  # already synced: nothing more
    with clock.step():  # begins at 2, never syncs: ends at 3
        pass
    assert clock.take() == 2.0
    assert clock.take() == 0.0


def test_the_line_names_the_slowest_rank_only_past_the_margin():
    row = {"slowest_rank": 3, "slowest_rank_s": 0.84, "fastest_rank_s": 0.2}
    assert straggler_note(row) == " | slowest rank 3 (0.84 s vs 0.20 s)"
    close = {"slowest_rank": 3, "slowest_rank_s": 0.23, "fastest_rank_s": 0.2}
    assert straggler_note(close) == ""
    assert straggler_note({"loss": 1.0}) == ""
