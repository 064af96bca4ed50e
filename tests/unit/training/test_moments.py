"""Optimizer moments in training checkpoints (`training/moments.py`), one process: the row
metadata of format 2, and training checkpoints written before it (whole tp shards in
`optim-model-tp{t}-pp{p}.safetensors`, no metadata, no `optimizer` record) still resume, to the
same optimizer state and the same losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tessera.core.checkpoint import CheckpointError
from tessera.training.config import load_config
from tessera.training.loop import plan_for_world, pretrain, setup
from tessera.training.moments import read_global_moments
from tessera.training.state import load_training_checkpoint
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def run8(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("run8") / "run"
    pretrain(load_config(pretrain_argv(tiny, run, model="gpt2-tiny"))[0])  # tied embeddings
    return run


def _as_legacy(step_dir: Path, to: Path) -> Path:
    """`step_dir` rewritten as the training state looked before format 2."""
    shutil.copytree(step_dir, to)
    new = to / "training" / "optim-tp00-pp00-dp00.safetensors"
    save_file(load_file(str(new)), str(to / "training" / "optim-model-tp00-pp00.safetensors"))
    new.unlink()
    for digests in to.glob("digests-rank*.json"):  # format 1 predates file digests too
        digests.unlink()
    manifest = json.loads((to / "manifest.json").read_text())
    del manifest["extra"]["training"]["optimizer"]
    (to / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return to


def test_format_2_names_the_rows_of_each_moment(run8):
    step4 = run8 / "checkpoints" / "step-00000004"
    with safe_open(str(step4 / "training" / "optim-tp00-pp00-dp00.safetensors"), "pt") as f:
        rows = json.loads(f.metadata()["moments"])
        for key in f.keys():
            n = f.get_slice(key).get_shape()[0]
            assert rows[key.split("/", 1)[1]] == [0, n, n]  # ddp: whole shards
    assert "output.weight" not in rows  # a tied copy has the embedding's moments


def test_checkpoints_from_before_format_2_still_resume(tiny, run8, tmp_path):
    step4 = run8 / "checkpoints" / "step-00000004"
    legacy = _as_legacy(step4, tmp_path / "legacy" / "checkpoints" / "step-00000004")
    moments = read_global_moments(step4)
    assert moments and set(moments) == set(read_global_moments(legacy))
    assert all(torch.equal(moments[k], read_global_moments(legacy)[k]) for k in moments)

    states = []
    for source in (step4, legacy):
        job = setup(*plan_for_world(load_config(pretrain_argv(tiny, tmp_path / "x",
                                                              model="gpt2-tiny"))[0]))
        load_training_checkpoint(source, job.stages, job.optimizer)
        states.append([job.optimizer.state[p] for g in job.optimizer.param_groups
                       for p in g["params"]])
    for a, b in zip(*states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    (legacy.parent / "latest").write_text("step-00000004\n")
    run = legacy.parent.parent
    pretrain(load_config(pretrain_argv(tiny, run, "--resume", model="gpt2-tiny"))[0])
    got, want = read_losses(run), read_losses(run8)
    assert {s: got[s] for s in range(5, 9)} == {s: want[s] for s in range(5, 9)}


def test_missing_rows_are_a_clear_error(run8, tmp_path):
    step4 = shutil.copytree(run8 / "checkpoints" / "step-00000004", tmp_path / "step-00000004")
    file = step4 / "training" / "optim-tp00-pp00-dp00.safetensors"
    with safe_open(str(file), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    rows = json.loads(meta["moments"])
    name = next(iter(rows))
    rows[name][1] -= 1  # claims one row fewer than the shard has
    tensors = {k: (v[:-1] if k.endswith("/" + name) else v) for k, v in tensors.items()}
    save_file(tensors, str(file), metadata={**meta, "moments": json.dumps(rows)})
    with pytest.raises(CheckpointError, match="missing"):
        read_global_moments(step4)
