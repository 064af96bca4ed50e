"""The engine core: one step of continuous batching, plus the aborts and timeouts between steps.

`step()` reads: the scheduler decides which requests run and how many of their tokens
(`serving.engine.scheduler`) -> the executor runs the model, whose runner prepares the inputs
and returns each scheduled request's logits (`serving.engine.runner`) -> the output processor
samples, verifies drafts, applies stops, detokenizes, finishes and counts
(`serving.engine.outputs`). With speculative decoding (`serving.engine.speculative`), drafts are
proposed before scheduling (the scheduler counts their tokens) and cut to what was scheduled.

`run_loop` steps until shutdown or a stopped rank; everything here runs on that thread, except
`abort` and setting `closing`, which any thread may do (under `lock`, which also guards the
engine's queue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from tessera.serving.engine.executor import Executor, StopServing
from tessera.serving.engine.outputs import OutputProcessor
from tessera.serving.engine.request import EngineRequest
from tessera.serving.engine.scheduler import Scheduler
from tessera.serving.engine.speculative import Speculator
from tessera.serving.engine.stats import EngineStats

log = logging.getLogger("tessera.serving")


class EngineCore:
    """The step loop and the request lifecycle around it; `wake` is set whenever there is news.

    Args:
        heartbeat_s: how long an idle loop waits before asking the executor for a heartbeat.
    """

    def __init__(self, executor: Executor, scheduler: Scheduler, outputs: OutputProcessor,
                 stats: EngineStats, *, pad_id: int, speculator: Speculator | None,
                 heartbeat_s: float):
        self.executor, self.scheduler, self.outputs = executor, scheduler, outputs
        self.stats, self.pad_id, self.speculator = stats, pad_id, speculator
        self.heartbeat_s = heartbeat_s
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self._aborts: deque[EngineRequest] = deque()
        self.closing = False  # shutdown asked: the loop ends at its next check
        self.alive = True  # False once stopped, for good
        self.looping = False
        self._stopped = False
        self.stop_callbacks: list[Callable[[], None]] = []

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
        # Grammar masks of the rows that sample, filled while the forward pass runs.
        self.outputs.sampler.prepare_masks(plan.rows)
        self.stats.count("steps_total")
        output = self.executor.execute_model(plan, self.pad_id)
        self.outputs.update_from_output(output)

    def abort(self, seq: EngineRequest) -> None:
        """Thread-safe: ask the engine thread to drop `seq` before its next step."""
        with self.lock:
            self._aborts.append(seq)
        self.wake.set()

    def apply_aborts(self) -> None:
        with self.lock:
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

    def run_loop(self, until: threading.Event | None = None) -> None:
        """Steps until shutdown, a stopped rank, or (if given) `until` is set while no request
        is in the engine; only the first two stop the engine."""
        stopped_by_rank, paused = False, False
        self.looping = True
        try:
            while True:
                self.wake.clear()
                self.apply_aborts()
                if self.closing:
                    break
                self.expire(time.monotonic())
                if not self.has_requests:
                    if until is not None and until.is_set():
                        paused = True
                        break
                    if not self.wake.wait(self.heartbeat_s) and not self.executor.heartbeat():
                        stopped_by_rank = True
                        break
                    continue
                try:
                    self.step()
                except StopServing:
                    raise
                except Exception as exc:  # a bug: fail what was running, keep serving
                    log.exception("engine step failed")
                    self.fail_running(f"engine step failed: {exc}")
        except StopServing as exc:
            log.warning("serving stops: %s", exc)
            stopped_by_rank = True
        except BaseException:
            log.exception("the engine loop died")
        finally:
            self.looping = False
            if not paused:
                self.stop(stopped_by_rank)

    def stop(self, stopped_by_rank: bool) -> None:
        """Once: fail what is left, release the other ranks, call the stop callbacks."""
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
        self.alive = False
        self.fail_all("the server is shutting down")
        if not stopped_by_rank:
            try:
                self.executor.close()
            except Exception:
                log.exception("could not release the other ranks")
        for fn in self.stop_callbacks:
            try:
                fn()
            except Exception:
                log.exception("stop callback failed")
