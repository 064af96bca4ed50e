"""`--async-save`: checkpoints written by a background thread hold the same bytes as
synchronous ones, each save reports how long it blocked the step, and a SIGKILL while the
writer is mid-checkpoint leaves `latest` on the previous one, from which the run resumes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tessera.training.checkpoint_saver import DELAY_ENV
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint, read_training_record
from tests.pretrain_helper import pretrain_argv, read_losses, tessera_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LONG = ("--steps", "30", "--warmup-steps", "5", "--save-interval", "10", "--log-interval", "5",
        "--keep-last", "0")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """One thread: runs match bit for bit."""


@pytest.fixture(scope="module")
def sync_run(tiny, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sync") / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *LONG))
    pretrain(cfg)
    return run


def _tensors(step_dir: Path) -> dict[str, dict]:
    return {p.relative_to(step_dir).as_posix(): load_file(p)
            for p in sorted(step_dir.rglob("*.safetensors"))}


def test_async_checkpoints_equal_sync_ones_and_report_the_blocked_time(tiny, sync_run, tmp_path,
                                                                       capsys):
    run = tmp_path / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *LONG, "--async-save"))
    assert cfg.loop.async_save
    summary = pretrain(cfg)
    out = capsys.readouterr().out
    assert out.count("written in the background in") == 3, out
    assert summary["checkpoint"].endswith("step-00000030")
    assert read_losses(run) == read_losses(sync_run)
    for step in (10, 20, 30):
        name = f"step-{step:08d}"
        a, b = _tensors(run / "checkpoints" / name), _tensors(sync_run / "checkpoints" / name)
        assert a.keys() == b.keys() and len(a) >= 3
        for file in a:
            assert a[file].keys() == b[file].keys()
            assert all(a[file][k].equal(b[file][k]) for k in a[file]), (name, file)
    assert latest_checkpoint(run).name == "step-00000030"


def test_sigkill_mid_async_write_leaves_the_previous_checkpoint(tiny, sync_run, tmp_path):
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, *LONG, "--async-save", "--resume")
    env = {**ENV, DELAY_ENV: "3"}  # the writer sleeps 3 s after each file
    proc = subprocess.Popen(tessera_command("pretrain", *argv), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, env=env)
    try:
        # Step 10's save is published when step 20's starts; kill once step 20's writer has
        # put its first file into the temporary directory (and is sleeping after it).
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = list((run / "checkpoints").glob(".step-00000020.tmp-*/*.safetensors"))
            if tmp:
                break
            time.sleep(0.05)
        assert tmp, "the step-20 save never started writing"
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (run / "checkpoints" / "step-00000020").exists()
    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step-00000010" and read_training_record(ckpt)["step"] == 10
    cfg, _ = load_config(argv)  # resumes from step 10, without the delay
    summary = pretrain(cfg)
    assert summary["steps"] == 30
    losses, full = read_losses(run), read_losses(sync_run)
    assert [losses[s] for s in range(1, 31)] == [full[s] for s in range(1, 31)]
    assert not [p.name for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
