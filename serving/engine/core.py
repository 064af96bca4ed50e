"""The engine core: one step of continuous batching, plus the aborts and timeouts between steps.

`step()` reads: the scheduler decides which requests run and how many of their tokens
(`serving.engine.scheduler`) -> the executor runs the model, whose runner prepares the inputs
and returns each scheduled request's logits (`serving.engine.runner`) -> the output processor
samples, verifies drafts, applies stops, detokenizes, finishes and counts
(`serving.engine.outputs`). With speculative decoding (`serving.engine.speculative`), drafts are
proposed before scheduling (the scheduler counts their tokens) and cut to what was scheduled.

Everything here runs on the engine thread, except `abort`, which any thread may call.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from tessera.serving.engine.executor import Executor
from tessera.serving.engine.outputs import OutputProcessor
from tessera.serving.engine.request import EngineRequest
from tessera.serving.engine.scheduler import Scheduler
from tessera.serving.engine.speculative import Speculator
from tessera.serving.engine.stats import EngineStats


class EngineCore:
    """The step and the request lifecycle around it; `wake` is set whenever there is news."""

    def __init__(self, executor: Executor, scheduler: Scheduler, outputs: OutputProcessor,
                 stats: EngineStats, *, pad_id: int, speculator: Speculator | None):
        self.executor, self.scheduler, self.outputs = executor, scheduler, outputs
        self.stats, self.pad_id, self.speculator = stats, pad_id, speculator
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._aborts: deque[EngineRequest] = deque()

    @property
    def has_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.num_waiting)

    def step(self) -> None:
        now = time.monotonic()
        if self.speculator is not None:  # drafts first: the scheduler counts their tokens
            self.speculator.propose(self.scheduler.running, self.scheduler.max_step_tokens)
        plan = self.scheduler.schedule()
        for seq in plan.admitted:
            if seq.preemptions == 0:
                self.stats.observe("queue_time_seconds", now - seq.arrival)
        if self.speculator is not None:
            self.speculator.fit(plan.rows, self.scheduler.running + plan.preempted)
        self.stats.count("steps_total")
        output = self.executor.execute_model(plan, self.pad_id)
        self.outputs.update_from_output(output)

    def abort(self, seq: EngineRequest) -> None:
        """Thread-safe: ask the engine thread to drop `seq` before its next step."""
        with self._lock:
            self._aborts.append(seq)
        self.wake.set()

    def apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = list(self._aborts), deque()
        for seq in aborts:
            if not seq.finished:
                seq.aborted = True
                self.outputs.finish(seq, "abort")

    def expire(self, now: float) -> None:
        """Finish the requests past their deadline with reason "timeout"."""
        late = self.scheduler.remove_waiting(lambda s: s.deadline is not None and now > s.deadline)
        late += [s for s in self.scheduler.running
                 if s.deadline is not None and now > s.deadline]
        for seq in late:
            self.outputs.finish(seq, "timeout")

    def fail_running(self, message: str) -> None:
        """A step failed (a bug): end what was running with an error, keep the rest."""
        for seq in list(self.scheduler.running):
            self.outputs.finish(seq, "error", message)

    def fail_all(self, message: str) -> None:
        """Shutdown: end every request, running or waiting, as aborted."""
        for seq in self.scheduler.drain():
            self.outputs.finish(seq, "abort", message)
