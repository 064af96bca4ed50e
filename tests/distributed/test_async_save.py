"""`--async-save` on 2 ranks (gloo): each rank writes its own files on its own background
thread, no collective runs there, and rank 0 publishes only after both have written (here rank
1's writer is slowed down); the checkpoints hold the same bytes as synchronous ones, and every
rank's files are hashed as written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from tessera.core.checkpoint_digests import damaged_files, recorded_digests
from tessera.training.checkpoint_saver import DELAY_ENV
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint
from tests.distributed_helper import run_ranks
from tests.pretrain_helper import pretrain_argv, read_losses

FLAGS = ("--tp", "2", "--log-interval", "1", "--keep-last", "0")


def _run_both(rank: int, world_size: int, sync_argv: list[str], async_argv: list[str]) -> None:
    pretrain(load_config(sync_argv)[0])
    if rank == 1:
        os.environ[DELAY_ENV] = "0.5"  # rank 1 writes its files long after rank 0
    pretrain(load_config(async_argv)[0])
    dist.barrier()


def _tensors(step_dir: Path) -> dict[str, dict]:
    return {p.relative_to(step_dir).as_posix(): load_file(p)
            for p in sorted(step_dir.rglob("*.safetensors"))}


@pytest.mark.timeout(600)
def test_async_save_on_two_ranks_equals_sync(tiny, tmp_path, one_thread):
    sync_run, async_run = tmp_path / "sync", tmp_path / "async"
    run_ranks(_run_both, 2, pretrain_argv(tiny, sync_run, *FLAGS),
              pretrain_argv(tiny, async_run, *FLAGS, "--async-save"), timeout=500)
    assert read_losses(async_run) == read_losses(sync_run)
    assert latest_checkpoint(async_run).name == "step-00000008"
    for name in ("step-00000004", "step-00000008"):
        a, b = _tensors(async_run / "checkpoints" / name), _tensors(sync_run / "checkpoints" / name)
        assert a.keys() == b.keys()
        assert {"model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"} <= a.keys()
        for file in a:
            assert all(a[file][k].equal(b[file][k]) for k in a[file]), (name, file)
        step_dir = async_run / "checkpoints" / name
        assert sorted(p.name for p in step_dir.glob("digests-rank*.json")) == [
            "digests-rank00000.json", "digests-rank00001.json"]
        assert "model-tp01-pp00.safetensors" in recorded_digests(step_dir)
        assert damaged_files(step_dir) == []
    assert not [p for p in (async_run / "checkpoints").iterdir() if ".tmp-" in p.name]
