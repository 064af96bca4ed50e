"""Training steps on CUDA never wait for the device: CUDA's sync detector, set to raise, sees
none in a tiny llama's steps (batch upload, forward/backward, clipping, fused AdamW), and the
logging step reads a whole window of losses and norms in one device-to-host copy."""

from __future__ import annotations

import pytest
import torch

from tessera.training.config import load_config
from tessera.training.loop import local_rows, plan_for_world, setup, train_step
from tessera.training.metrics import StepWindow
from tessera.training.objectives import objective_for
from tests.host_syncs import count_host_syncs
from tests.pretrain_helper import pretrain_argv


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_steps_do_not_sync(tiny, tmp_path, precision):
    cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "run", "--device", "cuda",
                                       "--precision", precision))
    plan, device = plan_for_world(cfg)
    job = setup(plan, device)
    train_ds, _ = objective_for(plan.model).datasets(plan)

    def step(s: int) -> dict:
        tokens, labels, extra = job.objective.split_batch(
            local_rows(train_ds, s, plan.data, job.groups, job.device))
        return train_step(job, s, tokens, labels, extra)

    step(0)  # the first step creates the optimizer state and the library handles
    torch.cuda.synchronize()
    window = StepWindow()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 4):
            window.add(s + 1, step(s))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with count_host_syncs() as syncs:
        rows, _ = window.resolve()
    assert syncs.total == 1, syncs.calls  # the window's one copy to the host
    assert [r["step"] for r in rows] == [2, 3, 4]
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 and r["grad_norm"] > 0
               for r in rows)
