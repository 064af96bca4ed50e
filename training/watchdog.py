"""A rank that stops answering ends the job, with the rank and the collective named.

Every rank records after each step how many steps it has completed, in the world's store
(`heartbeat/<rank>`: one store write, no collective). When a collective of a step fails on a
rank (gloo raises once `--collective-timeout-s` has passed, or when a peer that gave up closes
the connection), that rank records that it gave up, gives the others a few seconds to do the
same, and raises `RankHang` naming the ranks that did neither (the ones that stopped
answering), their last completed step, and the collective that failed. The CLI prints it and
exits with `HANG_EXIT_CODE`, so a launcher with restarts starts the job again.

The rank that stopped answering is ended by a watchdog thread when its step has run for
twice the collective timeout (by then the others have given up): without it, a rank stuck
outside any collective would outlive the job until the launcher's shutdown timeout.

Under NCCL a timed-out collective is reported by torch's own watchdog, which ends the rank;
the step-level message here is what gloo ranks print.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist

# EX_TEMPFAIL: the job failed for a reason that a restart may not meet again.
HANG_EXIT_CODE = 75
# How long a rank that gave up waits for the others to give up too before naming the silent.
GIVE_UP_GRACE_S = 5.0
# Test hooks: rank TESSERA_TEST_HANG_RANK stops answering (sleeps an hour) when it begins step
# TESSERA_TEST_HANG_AT_STEP (1-based, as logged); TESSERA_TEST_SLOW_RANK sleeps
# TESSERA_TEST_SLOW_S seconds at the start of every step.
HANG_HOOK = ("TESSERA_TEST_HANG_RANK", "TESSERA_TEST_HANG_AT_STEP")
SLOW_HOOK = ("TESSERA_TEST_SLOW_RANK", "TESSERA_TEST_SLOW_S")


class RankHang(RuntimeError):
    """A step's collective failed because some rank stopped answering; the message names it."""

    exit_code = HANG_EXIT_CODE


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that timed out or lost its peer (not a bug in the step)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("/gloo/" in text or "Connection closed by peer"
                                              in text or "Timed out waiting" in text)


def failed_collective(exc: BaseException) -> str:
    """The torch.distributed call `exc` came out of and the project code that made it, e.g.
    'all_reduce (from allreduce_gradients, core/parallel/data_parallel.py:57)'."""
    caller, op = None, None
    for frame in traceback.extract_tb(exc.__traceback__):
        if f"{os.sep}torch{os.sep}" not in frame.filename:
            caller, op = frame, None
        elif op is None and frame.filename.endswith("distributed_c10d.py"):
            op = frame.name
    op = op or "a collective"
    if caller is None:
        return op
    where = os.sep.join(caller.filename.split(os.sep)[-3:])
    return f"{op} (from {caller.name}, {where}:{caller.lineno})"


def describe_hang(step: int, rank: int, op: str, timeout_s: float, error: str,
                  last_steps: dict[int, int | None], gave_up: set[int]) -> str:
    """The message of a step whose collective failed on `rank`: the ranks that neither gave up
    nor finished the step (`last_steps`: each rank's completed steps, None if unknown)."""
    silent = [r for r, done in sorted(last_steps.items())
              if r != rank and r not in gave_up and (done is None or done < step)]
    if silent:
        who = "; ".join(f"rank {r} did not answer (last completed step {last_steps[r]})"
                        for r in silent)
    else:
        who = "every other rank gave up too (no single rank is to blame: check the network)"
    lines = error.strip().splitlines()
    detail = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]) if lines else "no detail"  # gloo's source
    return (f"step {step}: {who}; {op} failed on rank {rank} (collective timeout "
            f"{timeout_s:g} s: {detail}); the job stops with exit code {HANG_EXIT_CODE} so that "
            "a launcher with restarts can start it again (raise --collective-timeout-s if a "
            "rank was only slow)")


class StepWatchdog:
    """Heartbeats, the step-level catch and the stuck-step thread of one rank (see the
    module docstring), from `completed` steps on; a context manager, whose exit stops the
    thread. Alone (no process group) it only runs the steps."""

    def __init__(self, timeout_s: float, completed: int) -> None:
        self.timeout_s = timeout_s
        self.active = dist.is_initialized()
        self._begun: float | None = None
        self._step = completed
        self._closed = threading.Event()
        if not self.active:
            return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.PrefixStore("tessera/watchdog/",
                                      dist.distributed_c10d._get_default_store())
        self.store.delete_key(f"gave_up/{self.rank}")  # an earlier run's, in the same world
        self._beat(completed)
        threading.Thread(target=self._watch, name="tessera-step-watchdog", daemon=True).start()

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()

    def _beat(self, completed: int) -> None:
        self.store.set(f"heartbeat/{self.rank}", str(completed))

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step `step` (1-based, as logged): a collective that fails in it raises
        `RankHang`; on success the heartbeat records it."""
        if not self.active:
            yield
            return
        self._step, self._begun = step, time.monotonic()
        try:
            _test_hooks(self.rank, step)
            yield
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            raise RankHang(self._diagnose(step, exc)) from exc
        finally:
            self._begun = None
        self._beat(step)

    def _diagnose(self, step: int, exc: BaseException) -> str:
        self.store.set(f"gave_up/{self.rank}", str(step))
        others = [r for r in range(self.world) if r != self.rank]
        gave_up: set[int] = set()
        deadline = time.monotonic() + GIVE_UP_GRACE_S
        while len(gave_up) < len(others) and time.monotonic() < deadline:
            gave_up = {r for r in others if self.store.check([f"gave_up/{r}"])}
            time.sleep(0.2)
        last = {r: int(self.store.get(f"heartbeat/{r}")) for r in others}
        return describe_hang(step, self.rank, failed_collective(exc), self.timeout_s, str(exc),
                             last, gave_up)

    def _watch(self) -> None:
        limit = 2 * self.timeout_s
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            begun = self._begun
            if begun is not None and time.monotonic() - begun > limit:
                print(f"rank {self.rank}: step {self._step} has run for more than {limit:g} s "
                      "(twice --collective-timeout-s) and the other ranks have given up on it; "
                      f"ending this rank (exit code {HANG_EXIT_CODE})", file=sys.stderr,
                      flush=True)
                os._exit(HANG_EXIT_CODE)


def _test_hooks(rank: int, step: int) -> None:
    """The environment's test hooks (`HANG_HOOK`, `SLOW_HOOK`) for this rank and step."""
    env = os.environ
    if env.get(HANG_HOOK[0]) == str(rank) and env.get(HANG_HOOK[1]) == str(step):
        time.sleep(3600)
    if env.get(SLOW_HOOK[0]) == str(rank):
        time.sleep(float(env.get(SLOW_HOOK[1], "0.1")))

