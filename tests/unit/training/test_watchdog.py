"""The watchdog's pieces: which errors are collective failures, the collective a traceback
names, the message, and a one-rank world's step (heartbeat, the catch). The job-level
behaviour (a silent rank ends a launched job) is tests/distributed/test_hangs.py."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from tessera.training.watchdog import (
    HANG_EXIT_CODE,
    RankHang,
    StepWatchdog,
    describe_hang,
    failed_collective,
    is_collective_failure,
)

GLOO_TIMEOUT = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 5000ms for recv operation to complete")


def _fake_all_reduce():
    """A function named all_reduce whose frame lies in torch's distributed_c10d.py."""
    code = compile(f"def all_reduce():\n    raise RuntimeError({GLOO_TIMEOUT!r})\n",
                   "/site-packages/torch/distributed/distributed_c10d.py", "exec")
    scope: dict = {}
    exec(code, scope)
    return scope["all_reduce"]


def sync_gradients(all_reduce):
    all_reduce()


def test_collective_failures_are_told_from_bugs():
    assert is_collective_failure(RuntimeError(GLOO_TIMEOUT))
    assert is_collective_failure(RuntimeError("[pair.cc:598] Connection closed by peer [::1]:1"))
    assert is_collective_failure(dist.DistBackendError("NCCL error"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError(GLOO_TIMEOUT))


def test_the_failed_collective_and_its_caller_are_named():
    with pytest.raises(RuntimeError) as info:
        sync_gradients(_fake_all_reduce())
    named = failed_collective(info.value)
    assert named.startswith("all_reduce (from sync_gradients, unit/training/test_watchdog.py:")
    assert failed_collective(RuntimeError("no traceback")) == "a collective"


def test_the_message_names_the_silent_rank_and_drops_gloos_source_path():
    text = describe_hang(7, 0, "all_reduce (from f, a/b.py:3)", 5, GLOO_TIMEOUT,
                         {1: 6, 2: 6, 3: 6}, gave_up={2, 3})
    assert text.startswith("step 7: rank 1 did not answer (last completed step 6); "
                           "all_reduce (from f, a/b.py:3) failed on rank 0 (collective timeout "
                           "5 s: Timed out waiting 5000ms for recv operation to complete)")
    assert f"exit code {HANG_EXIT_CODE}" in text and "rank 2" not in text


def test_a_rank_that_finished_the_step_or_gave_up_is_not_blamed():
    text = describe_hang(7, 0, "barrier", 5, "", {1: 7, 2: 6}, gave_up={2})
    assert "did not answer" not in text and "every other rank gave up too" in text


def test_alone_the_watchdog_only_runs_the_step():
    watchdog = StepWatchdog(5, completed=0)
    with watchdog.step(1):
        pass
    with pytest.raises(RuntimeError, match="Timed out"), watchdog.step(2):
        raise RuntimeError(GLOO_TIMEOUT)  # no world: nothing to diagnose


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_step_records_its_heartbeat_and_a_collective_failure_is_a_rank_hang(one_rank_world):
    with StepWatchdog(5, completed=3) as watchdog:
        assert watchdog.store.get("heartbeat/0") == b"3"
        with watchdog.step(4):
            pass
        assert watchdog.store.get("heartbeat/0") == b"4"
        with pytest.raises(RankHang, match="^step 5: every other rank gave up") as info, \
                watchdog.step(5):
            sync_gradients(_fake_all_reduce())
        assert info.value.exit_code == HANG_EXIT_CODE
        assert watchdog.store.get("heartbeat/0") == b"4"  # step 5 did not complete
        with pytest.raises(ZeroDivisionError), watchdog.step(5):  # not a collective: as it is
            1 / 0  # noqa: B018
    for thread in threading.enumerate():  # leaving the watchdog stops its thread
        if thread.name == "tessera-step-watchdog":
            thread.join(timeout=30)
            assert not thread.is_alive()
