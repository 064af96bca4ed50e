"""How a step reaches the model: the `Executor` the engine calls, and the one-process executor.

The engine hands the scheduler's output to `Executor.execute_model`; the executor's runner
(`serving.engine.runner.ModelRunner`) prepares each pass's `StepBatch` and `Executor.run` runs
it: in this process (`LocalExecutor`), or on every rank of a tensor/pipeline-parallel layout
with rank 0 broadcasting the batch (`serving.engine.distributed.DistributedExecutor`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tessera.serving.engine.runner import ModelRunner, RunnerOutput, StepBatch
    from tessera.serving.engine.scheduler import StepPlan


class StopServing(RuntimeError):
    """The serving job is stopping: a rank asked to, or the ranks can no longer talk."""


class Executor(Protocol):
    """What the engine needs to run a step (`LocalExecutor`, `distributed.DistributedExecutor`)."""

    runner: ModelRunner  # this process's share (rank 0 always holds the first stage)

    def execute_model(self, plan: StepPlan, pad_id: int) -> RunnerOutput:
        """The logits each scheduled request of `plan` needs (`ModelRunner.execute_model`).

        Raises `StopServing` when the job must stop; a failing pass fails its rows only."""
        ...

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits `(N, vocab)` fp32 of the kept positions, on `runner.device`.

        Raises `StopServing` when the job must stop; any other exception fails this batch only.
        """
        ...

    def heartbeat(self) -> bool:
        """Called about once a second while idle; False means some rank asked to stop."""
        ...

    def close(self) -> None:
        """Release the other ranks (they return from their worker loop)."""
        ...


class LocalExecutor:
    """Runs every step in this process (no tensor or pipeline parallelism)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute_model(self, plan: StepPlan, pad_id: int) -> RunnerOutput:
        return self.runner.execute_model(plan, pad_id, self.run)

    def run(self, batch: StepBatch) -> torch.Tensor:
        out = self.runner.forward(self.runner.place(batch))
        assert out is not None  # a single process holds the last stage
        return out

    def heartbeat(self) -> bool:
        return True

    def close(self) -> None:
        pass
