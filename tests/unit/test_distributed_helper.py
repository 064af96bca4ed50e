"""The multi-rank harness itself: results by rank, forwarded errors, and the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tessera.core.parallel.spawn import run_ranks


def _all_reduce(rank: int, world_size: int, n: int) -> dict:
    t = torch.arange(n, dtype=torch.float32) + rank
    dist.all_reduce(t)
    return {
        "rank": rank,
        "sum": t.tolist(),
        "threads": torch.get_num_threads(),
        "env": os.environ.get("TESSERA_TEST_FLAG"),
    }


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.all_reduce(torch.ones(1))  # rank 0 waits in a collective that rank 1 never joins


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)


def _die_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def test_all_reduce_results_come_back_by_rank():
    out = run_ranks(_all_reduce, 2, 4, env={"TESSERA_TEST_FLAG": "on"})
    expected = [2 * i + 1.0 for i in range(4)]  # (i + 0) + (i + 1)
    assert out == [{"rank": r, "sum": expected, "threads": 1, "env": "on"} for r in range(2)]
    assert "TESSERA_TEST_FLAG" not in os.environ  # env is for the ranks only


def test_forked_ranks_see_the_callers_environment_as_it_is_now(monkeypatch):
    # Forked ranks come from a forkserver started by an earlier call, with the environment of
    # that moment; they must see the caller's current one (tests set variables like this).
    run_ranks(_all_reduce, 2, 1)  # the server is running before the variable is set
    monkeypatch.setenv("TESSERA_TEST_FLAG", "set-later")
    out = run_ranks(_all_reduce, 2, 1)
    assert [r["env"] for r in out] == ["set-later", "set-later"]


def test_exception_on_a_rank_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed") as info:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    assert "ValueError: rank one is unhappy" in str(info.value)
    assert "_fail_on_rank_1" in str(info.value)  # the traceback text, not just the message


@pytest.mark.timeout(60)
def test_hang_is_killed_after_timeout_naming_the_unfinished_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 8 s"):
        run_ranks(_hang_on_rank_1, 2, timeout=8)


def test_rank_that_dies_without_reporting_is_an_error():
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 3"):
        run_ranks(_die_on_rank_1, 2, timeout=60)


def test_ranks_that_cannot_start_in_time_are_named():
    # A run given `env` is spawned, and a spawned rank imports torch: well over a second (a
    # forked one starts in less than 0.5 s). The run's own `timeout` only starts once every
    # rank has joined the group.
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not start within 0.5 s"):
        run_ranks(_all_reduce, 2, 4, timeout=60, startup_timeout=0.5,
                  env={"TESSERA_TEST_FLAG": "spawned"})
