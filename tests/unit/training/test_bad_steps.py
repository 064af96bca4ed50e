"""Bad steps: a non-finite step applies no update and the run goes on; persisting trouble stops
the run or rolls it back past the batches that caused it (`training.bad_steps`).

NaN is injected into one global batch's gradients through the test hook
`bad_steps.TEST_NAN_BATCH` (in a process: the TESSERA_TEST_NAN_BATCH environment variable).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.core.config import ConfigError
from tessera.training import bad_steps
from tessera.training import loop as loop_module
from tessera.training.bad_steps import BadStepMonitor, DataWindows, step_unless_bad
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint, read_training_record
from tests.pretrain_helper import pretrain_argv, read_losses


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a training checkpoint's weight and optimizer-moment files, by file and
    name."""
    out = {}
    for file in sorted([*checkpoint.glob("*.safetensors"),
                        *(checkpoint / "training").glob("optim-*.safetensors")]):
        out.update({f"{file.name}:{k}": v for k, v in load_file(str(file)).items()})
    assert out
    return out


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


# ------------------------------------------------------------------------- skip on the device


def test_a_nan_step_is_skipped_and_the_run_goes_on(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", 4)  # the batch of step 5
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, "--save-interval", "1", "--keep-last", "0",
                                       "--log-interval", "4"))
    summary = pretrain(cfg)
    steps = {r["step"]: r for r in _rows(run) if "step" in r}
    assert sorted(steps) == list(range(1, 9))
    assert [s for s, r in steps.items() if r["bad_step"]] == [5]
    assert steps[5]["grad_norm"] is None  # NaN, written as null
    assert [steps[s]["skipped_steps"] for s in (4, 5, 8)] == [0, 1, 1]
    assert summary["skipped_steps"] == 1 and summary["steps"] == 8
    assert all(torch.isfinite(torch.tensor(steps[s]["loss"])) for s in steps)
    # Step 5 changed nothing: weights, moments and AdamW's step count are step 4's, bit for bit.
    after4, after5, after6 = (tmp_path / f"run/checkpoints/step-{s:08d}" for s in (4, 5, 6))
    _assert_bit_identical(_tensors(after4), _tensors(after5))
    assert [read_training_record(c)["optimizer_step"] for c in (after4, after5, after6)] == \
        [4, 4, 5]
    five, six = _tensors(after5), _tensors(after6)  # and step 6 trained again
    assert all(not torch.equal(five[k], six[k]) for k in five)


def test_the_fused_update_is_skipped_without_reading_the_device():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.1, fused=True)
    p.grad = torch.ones(3, 2)
    step_unless_bad(opt, torch.tensor(True))
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.full((3, 2), float("nan"))
    step_unless_bad(opt, torch.tensor(False))
    assert torch.equal(p, before[0]) and not hasattr(opt, "found_inf")
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    p.grad = torch.ones(3, 2)
    step_unless_bad(opt, torch.tensor(True))
    assert not torch.equal(p, before[0]) and int(opt.state[p]["step"]) == 2


def test_an_unfused_optimizer_is_skipped_too():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    p.grad = torch.full((2,), float("nan"))
    step_unless_bad(opt, torch.tensor(False))
    assert torch.equal(p, torch.ones(2)) and not opt.state


# ------------------------------------------------------------------------------ stop, rollback


def test_stop_names_the_step(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", 2)
    cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "run", "--max-bad-steps", "1",
                                       "--log-interval", "4"))
    with pytest.raises(FloatingPointError, match=r"^step 3: 1 consecutive steps had a "
                                                 r"non-finite loss or gradient norm .*stop"):
        pretrain(cfg)


ROLLBACK = ("--steps", "10", "--save-interval", "4", "--keep-last", "0", "--log-interval", "2")


def test_rollback_skips_the_window_and_equals_a_run_that_never_saw_it(tiny, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", 5)  # step 6, read at logging step 6
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *ROLLBACK, "--bad-step-policy", "rollback",
                                       "--max-bad-steps", "1"))
    summary = pretrain(cfg)
    assert "the batches of steps 5-6 (numbered as in a run that skips nothing) are skipped" \
        in capsys.readouterr().out
    assert summary["rollbacks"] == 1 and summary["steps"] == 10
    final = latest_checkpoint(run)
    assert final.name == "step-00000010"
    assert read_training_record(final)["skipped_batches"] == [[4, 6]]

    # A run told to skip the same batches from the start ends in the same state, bit for bit.
    reference = tmp_path / "reference"
    cfg, _ = load_config(pretrain_argv(tiny, reference, *ROLLBACK, "--skip-data-steps", "5-6"))
    pretrain(cfg)
    _assert_bit_identical(_tensors(final), _tensors(latest_checkpoint(reference)))
    rolled, ref = read_losses(run), read_losses(reference)
    assert [rolled[s] for s in range(1, 11)] == [ref[s] for s in range(1, 11)]

    # Resuming the rolled-back run from a later checkpoint keeps skipping the window.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000010")
    (resumed / "checkpoints" / "latest").write_text("step-00000008\n")
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", None)
    cfg, _ = load_config(pretrain_argv(tiny, resumed, *ROLLBACK, "--resume"))
    pretrain(cfg)
    _assert_bit_identical(_tensors(final), _tensors(latest_checkpoint(resumed)))


def test_a_loss_spike_rolls_back_past_its_batches(tiny, tmp_path, monkeypatch):
    real_step = loop_module.train_step

    def spiking_step(job, step, *args, batch=None, **kwargs):
        metrics = real_step(job, step, *args, batch=batch, **kwargs)
        if batch == 6:  # the batch of step 7 "spikes" (as reported; the update is applied)
            metrics["loss"] = metrics["loss"] * 50
        return metrics

    monkeypatch.setattr(loop_module, "train_step", spiking_step)
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *ROLLBACK, "--bad-step-policy", "rollback",
                                       "--loss-spike-factor", "3", "--loss-spike-window", "2"))
    summary = pretrain(cfg)
    assert summary["rollbacks"] == 1 and summary["skipped_steps"] == 0
    assert read_training_record(latest_checkpoint(run))["skipped_batches"] == [[4, 8]]
    reference = tmp_path / "reference"
    cfg, _ = load_config(pretrain_argv(tiny, reference, *ROLLBACK, "--skip-data-steps", "5-8"))
    pretrain(cfg)
    _assert_bit_identical(_tensors(latest_checkpoint(run)), _tensors(latest_checkpoint(reference)))


def test_the_hook_is_read_from_the_environment_once():
    code = "from tessera.training import bad_steps; print(bad_steps.TEST_NAN_BATCH)"
    env = {**os.environ, bad_steps.TEST_NAN_BATCH_ENV: "5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "5"


def test_rollback_without_a_checkpoint_is_an_error(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", 1)
    cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "run", *ROLLBACK, "--bad-step-policy",
                                       "rollback", "--max-bad-steps", "1"))
    with pytest.raises(FloatingPointError, match="step 2: .*found no checkpoint .* to roll back"):
        pretrain(cfg)


# ------------------------------------------------------------------------ the policy's pieces


def _row(step: int, loss: float, bad: bool = False) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0, "bad_step": float(bad)}


def test_consecutive_bad_steps_count_across_windows():
    monitor = BadStepMonitor("rollback", 3, 0.0, 4)
    assert monitor.check([_row(1, 2.0), _row(2, 2.0, True)]) is None
    assert monitor.check([_row(3, 2.0, True), _row(4, 2.0), _row(5, 2.0, True)]) is None
    rows = [_row(6, 2.0, True), _row(7, float("nan")), _row(8, 2.0)]
    verdict = monitor.check(rows)
    assert verdict.step == 7 and "3 consecutive steps" in verdict.reason
    assert [r["skipped_steps"] for r in rows] == [4, 5, 5] and monitor.skipped == 5


def test_a_spike_is_judged_against_the_running_mean_once_it_has_a_full_window():
    monitor = BadStepMonitor("stop", 5, 2.0, 3)
    assert monitor.check([_row(1, 1.0), _row(2, 9.0), _row(3, 1.0)]) is None  # too early
    assert monitor.check([_row(4, 1.0, True), _row(5, 1.0)]) is None  # bad steps not counted
    with pytest.raises(FloatingPointError, match=r"^step 6: the loss spiked to 8.0000, over 2 x "
                                                 r"the mean 3.6667 of the last 3 steps"):
        monitor.check([_row(6, 8.0)])
    assert BadStepMonitor("skip", 5, 2.0, 1).check([_row(1, 1.0), _row(2, 3.0)]).step == 2


def test_data_windows_map_steps_past_the_skipped_batches():
    windows = DataWindows.parse(["5-8", "3-3"])
    assert windows.windows == [(2, 3), (4, 8)]
    assert [windows.batch(s) for s in range(6)] == [0, 1, 3, 8, 9, 10]
    windows.skip(3, 4)  # adjacent windows become one
    assert windows.record() == [[2, 8]]
    assert DataWindows.from_record(windows.record()) == windows


@pytest.mark.parametrize("spec", ["5", "0-3", "7-5", "a-b"])
def test_bad_skip_ranges_are_refused(spec):
    with pytest.raises(ConfigError, match="--skip-data-steps takes ranges"):
        DataWindows.parse([spec])


def test_an_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="--bad-step-policy must be one of stop, rollback, skip here"):
        BadStepMonitor("retry", 1, 0.0, 1)


def test_the_zero_wrapper_skips_through_its_fused_optimizer():
    from tessera.core.parallel.zero import ShardedOptimizer

    p = torch.nn.Parameter(torch.ones(4, 2))
    opt = ShardedOptimizer([p], None, 0, 1, torch.optim.AdamW, lr=0.1, fused=True)
    p.grad = torch.ones(4, 2)
    step_unless_bad(opt, torch.tensor(True))
    before = p.detach().clone()
    p.grad = torch.full((4, 2), float("inf"))
    step_unless_bad(opt, torch.tensor(False))
    assert torch.equal(p, before) and not hasattr(opt.inner, "found_inf")
    assert [int(s["step"]) for s in opt.state.values()] == [1]


def test_rollback_waits_for_an_asynchronous_save_in_flight(tiny, tmp_path, monkeypatch):
    # The step-4 save is still being written (slowly) when step 6's NaN is read: the rollback
    # publishes it first and returns to it, as the synchronous run does.
    monkeypatch.setattr(bad_steps, "TEST_NAN_BATCH", 5)
    monkeypatch.setenv("TESSERA_TEST_SAVE_FILE_DELAY_S", "0.2")
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *ROLLBACK, "--bad-step-policy", "rollback",
                                       "--max-bad-steps", "1", "--async-save"))
    summary = pretrain(cfg)
    assert summary["rollbacks"] == 1
    monkeypatch.delenv("TESSERA_TEST_SAVE_FILE_DELAY_S")
    reference = tmp_path / "reference"
    cfg, _ = load_config(pretrain_argv(tiny, reference, *ROLLBACK, "--skip-data-steps", "5-6"))
    pretrain(cfg)
    _assert_bit_identical(_tensors(latest_checkpoint(run)),
                          _tensors(latest_checkpoint(reference)))
