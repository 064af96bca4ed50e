"""Every file of a checkpoint is hashed as it is written; a flipped byte is caught by load,
resume, `latest` and `tessera inspect --verify`, each naming the file."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest

from tessera.converters.inspect import main as inspect_main
from tessera.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tessera.core.checkpoint_digests import file_digest, recorded_digests
from tessera.core.init import build_model
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint, load_training_checkpoint
from tests.pretrain_helper import pretrain_argv, read_losses

WEIGHTS = "model-tp00-pp00.safetensors"
OPTIMIZER = "training/optim-tp00-pp00-dp00.safetensors"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """One thread: resumed losses match the uninterrupted run bit for bit."""


@pytest.fixture(scope="module")
def run8(tiny, tmp_path_factory) -> Path:
    """An 8-step run with checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("digests") / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run))
    pretrain(cfg)
    return run


@pytest.fixture
def run(run8, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run8, copy)
    return copy


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor: the header still matches the manifest
    path.write_bytes(bytes(data))


def test_every_file_written_is_recorded_and_matches(run8):
    step8 = run8 / "checkpoints" / "step-00000008"
    digests = recorded_digests(step8)
    written = {p.relative_to(step8).as_posix() for p in step8.rglob("*") if p.is_file()}
    assert set(digests) == written - {"manifest.json", "digests-rank00000.json"}
    assert {WEIGHTS, OPTIMIZER, "tokenizer.model", "training/rng-rank00000.safetensors"} <= \
        set(digests)
    assert all(file_digest(step8 / f) == d for f, d in digests.items())


@pytest.mark.parametrize("damaged", [WEIGHTS, OPTIMIZER])
def test_a_flipped_byte_is_named_by_load_resume_latest_and_inspect(tiny, run, damaged, capsys):
    step8 = run / "checkpoints" / "step-00000008"
    _flip_last_byte(step8 / damaged)
    # latest: the newest step that verifies, with a warning naming the damaged file.
    assert latest_checkpoint(run).name == "step-00000004"
    assert f"step-00000008: {damaged} is damaged (sha256 mismatch)" in capsys.readouterr().err
    assert latest_checkpoint(run, verify=False).name == "step-00000008"
    with pytest.raises(CheckpointError, match=f"step-00000008: {damaged} is damaged.*"
                                              "resume from an earlier step \\(step-00000004"):
        load_training_checkpoint(step8, [], None)
    if damaged == WEIGHTS:
        with pytest.raises(CheckpointError, match=f"{damaged} is damaged"):
            load_checkpoint(step8)
    assert inspect_main([str(step8), "--verify"]) == 1
    assert f"damaged: {damaged}: damaged (sha256 mismatch)" in capsys.readouterr().err
    assert inspect_main([str(step8)]) == 0  # headers alone do not see it
    assert inspect_main([str(run / "checkpoints" / "step-00000004"), "--verify"]) == 0
    # Resume continues from step 4 and ends on the uninterrupted losses.
    full = read_losses(run)
    (run / "metrics.jsonl").unlink()
    cfg, _ = load_config(pretrain_argv(tiny, run, "--resume"))
    summary = pretrain(cfg)
    assert "resumed from" in capsys.readouterr().out
    resumed = read_losses(run)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[s] for s in range(5, 9)] == [full[s] for s in range(5, 9)]
    assert summary["checkpoint"].endswith("step-00000008")
    assert latest_checkpoint(run).name == "step-00000008"  # saved afresh


def test_a_missing_file_is_named(run):
    step8 = run / "checkpoints" / "step-00000008"
    (step8 / OPTIMIZER).unlink()
    with pytest.raises(CheckpointError, match=f"{OPTIMIZER} is missing"):
        load_training_checkpoint(step8, [], None)


def test_digests_are_taken_while_writing_not_by_reading_back(tmp_path, monkeypatch):
    """Opening any file under the checkpoint for reading during the save fails the test."""
    from tessera.core.config import ModelConfig

    model = build_model(ModelConfig.from_name("llama-tiny", num_layers=1), seed=0)
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not a real tokenizer, only copied")
    real_open, target = builtins.open, tmp_path / "ckpt"

    def no_reads(file, mode="r", *args, **kwargs):
        inside = str(file).startswith(str(target.parent / f".{target.name}"))
        if inside and not any(c in mode for c in "wax"):
            raise AssertionError(f"{file} was read back during the save")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_reads)
    save_checkpoint(target, model, tokenizer=tokenizer)
    monkeypatch.setattr(builtins, "open", real_open)
    digests = recorded_digests(target)
    assert set(digests) == {WEIGHTS, "tokenizer.model"}
    assert all(file_digest(target / f) == d for f, d in digests.items())


def test_a_checkpoint_without_digests_still_loads(tmp_path, capsys):
    from tessera.core import checkpoint
    from tessera.core.config import ModelConfig

    path = save_checkpoint(tmp_path / "old", build_model(
        ModelConfig.from_name("llama-tiny", num_layers=1), seed=0))
    (path / "digests-rank00000.json").unlink()  # as written before digests were recorded
    checkpoint._UNVERIFIED_WARNED.clear()
    load_checkpoint(path)
    load_checkpoint(path)
    err = capsys.readouterr().err
    assert err.count("records no file digests") == 1, err
    assert json.loads((path / "manifest.json").read_text())["step"] == 0
