"""A training step does not wait for the device: losses and gradient norms are read at logging
steps only, a whole window at once (`metrics.StepWindow`), and every step is still reported.

The waits are counted on the CPU with `tests.host_syncs` (the calls that block on CUDA);
tests/gpu/test_sync_free_step.py runs the steps under CUDA's own sync detector.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.training import loop as loop_module
from tessera.training.config import load_config
from tessera.training.metrics import StepWindow, checked_losses
from tests.host_syncs import count_host_syncs
from tests.pretrain_helper import pretrain_argv, read_losses

STEPS, LOG_INTERVAL = 6, 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


def test_only_logging_steps_read_the_device(tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, "--steps", str(STEPS), "--log-interval",
                                       str(LOG_INTERVAL), "--save-interval", "0"))
    real_step = loop_module.train_step

    def labelled_step(job, step, *args, **kwargs):
        syncs.label = step + 1  # what follows, up to the next step, is counted for this one
        return real_step(job, step, *args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", labelled_step)
    with count_host_syncs() as syncs:
        summary = loop_module.pretrain(cfg)
    per_step = {s: syncs.count_for(s) for s in range(1, STEPS + 1)}
    # Steps 1 (the first) and 3 print a line; 6 also saves and evaluates, so it is left out.
    assert [per_step[s] for s in (2, 4, 5)] == [0, 0, 0], syncs.calls
    assert per_step[1] <= 1 and per_step[3] <= 1, syncs.calls
    losses = read_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert summary["first_loss"] == losses[1] and summary["final_loss"] == losses[STEPS]


def test_every_step_is_reported_with_its_own_loss_and_norm(tiny, tmp_path):
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, "--steps", "4", "--log-interval", "4",
                                       "--save-interval", "0"))
    loop_module.pretrain(cfg)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float)
               for r in steps)
    assert len({r["loss"] for r in steps}) == 4 and len({r["grad_norm"] for r in steps}) == 4
    # Steps 2-4 share one window: the same mean rate.
    assert steps[1]["tokens_per_s"] == steps[2]["tokens_per_s"] == steps[3]["tokens_per_s"] > 0


def test_the_window_reads_its_tensors_in_order_once():
    window = StepWindow()
    for step in (1, 2):
        window.add(step, {"loss": torch.tensor(float(step)), "lr": 0.1 * step,
                          "grad_norm": torch.tensor(10.0 * step)})
    with count_host_syncs() as syncs:
        rows, elapsed = window.resolve()
    assert syncs.total == 1, syncs.events  # the one read of the window (a copy on a device)
    assert rows == [{"loss": 1.0, "lr": 0.1, "grad_norm": 10.0, "step": 1},
                    {"loss": 2.0, "lr": 0.2, "grad_norm": 20.0, "step": 2}]
    assert elapsed >= 0 and window.resolve()[0] == []


def test_a_non_finite_loss_names_the_first_step_it_appeared_at():
    rows = [{"step": 7, "loss": 2.0}, {"step": 8, "loss": float("nan")},
            {"step": 9, "loss": float("inf")}]
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 8 \(found at step 9"):
        checked_losses(rows, 9)
    assert checked_losses(rows[:1], 7) == [2.0]
