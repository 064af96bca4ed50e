"""Training checkpoints saved in place or in the background, at most one in flight.

A save takes this rank's tensors first (`prepare_training_checkpoint`; asynchronous saves copy
them to host memory, pinned on CUDA: the only part that holds up the step), then writes and
hashes the files (`CheckpointWrite.write`), then publishes the directory (one rename by rank 0,
`latest`, pruning). An asynchronous save writes on a background thread; every collective
(the barrier before the rename included) stays on the training thread, because a collective
from a side thread while the training thread runs its own can deadlock. So an in-flight save is
published by the training thread: at a logging boundary once every rank has written its part
(`poll`), before the next save starts (`save`), or at the end of the run (`finish`). A crash
before the rename leaves only a temporary directory (pruned by the next save) and `latest` on
the previous checkpoint.

`TESSERA_TEST_SAVE_FILE_DELAY_S` (tests only) makes the writer sleep after each file, so a test
can kill the process while a save is being written.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.core.checkpoint import CheckpointWrite
from tessera.training.state import prepare_training_checkpoint, publish_training_checkpoint

DELAY_ENV = "TESSERA_TEST_SAVE_FILE_DELAY_S"


@dataclass(frozen=True)
class SaveReport:
    """A published checkpoint and what its save cost the training loop."""

    path: Path
    step: int
    blocked_s: float  # the step waited this long
    written_s: float  # writing the files took this long (in the background when asynchronous)
    background: bool

    def describe(self) -> str:
        if not self.background:
            return f"save blocked the step for {self.blocked_s:.2f} s"
        return (f"save blocked the step for {self.blocked_s:.2f} s; written in the background "
                f"in {self.written_s:.2f} s")


class _InFlight:
    """One save being written by a background thread."""

    def __init__(self, pending: CheckpointWrite, step: int, blocked_s: float,
                 between_files: Any) -> None:
        self.pending, self.step, self.blocked_s = pending, step, blocked_s
        self.error: BaseException | None = None
        self.written_s = 0.0
        self.thread = threading.Thread(target=self._write, args=(between_files,),
                                       name="tessera-checkpoint-writer", daemon=True)
        self.thread.start()

    def _write(self, between_files: Any) -> None:
        start = time.perf_counter()
        try:
            self.pending.write(between_files)
        except BaseException as exc:  # re-raised on the training thread by `finish`
            self.error = exc
        self.written_s = time.perf_counter() - start


class CheckpointSaver:
    """Saves a run's training checkpoints into `run_dir`, keeping the newest `keep_last`;
    `asynchronous`: written by a background thread. Every method is collective over all ranks
    (each calls it at the same step); `device` carries `poll`'s agreement."""

    def __init__(self, run_dir: str | os.PathLike, *, keep_last: int, asynchronous: bool,
                 device: torch.device) -> None:
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        self.device = device
        self._in_flight: _InFlight | None = None
        delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        self._between_files = (lambda: time.sleep(delay)) if delay > 0 else None

    def save(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer, *,
             step: int, **state: Any) -> list[SaveReport]:
        """Save the checkpoint of `step` (`state`: `prepare_training_checkpoint`'s keywords).
        Returns the saves published by this call: the previous one (waited for first, so at
        most one is in flight) and, unless asynchronous, this one."""
        published = self.finish()
        start = time.perf_counter()
        pending = prepare_training_checkpoint(self.run_dir, models, optimizer, step=step,
                                              copy=self.asynchronous, **state)
        if self.asynchronous:
            self._in_flight = _InFlight(pending, step, time.perf_counter() - start,
                                        self._between_files)
            return published
        pending.write(self._between_files)
        path = publish_training_checkpoint(self.run_dir, pending, self.keep_last)
        took = time.perf_counter() - start
        return [*published, SaveReport(path, step, took, took, background=False)]

    def poll(self) -> list[SaveReport]:
        """Publish the in-flight save if every rank has finished writing it (asks the other
        ranks under torch.distributed; never waits for a write)."""
        if self._in_flight is None:
            return []
        written = not self._in_flight.thread.is_alive()
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor(float(written), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            written = bool(flag)
        return self.finish() if written else []

    def finish(self) -> list[SaveReport]:
        """Wait for the in-flight save, if any, and publish it. Raises what its writer raised."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return []
        job.thread.join()
        if job.error is not None:
            raise job.error
        path = publish_training_checkpoint(self.run_dir, job.pending, self.keep_last)
        return [SaveReport(path, job.step, job.blocked_s, job.written_s, background=True)]
