"""The one atomic directory writer and the checkpoint-series helper of `core.checkpoint`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tessera.core.checkpoint import CheckpointSeries, atomic_directory, publish_directory


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_directory_replaces_only_on_success(tmp_path: Path):
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("two")
        raise RuntimeError("crash mid-write")
    assert (final / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp left behind
    with atomic_directory(final) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    with pytest.raises(FileExistsError, match="--overwrite"), atomic_directory(final, False):
        pass


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755),
                                                    (0o077, 0o600, 0o700)])
def test_published_files_get_the_mode_a_plain_open_gives(tmp_path: Path, mask, file_mode,
                                                        dir_mode):
    """Files that safetensors or mkstemp made 0600 are published with the umask's mode: readable
    by a non-root container under the usual umask 022, private only when the user asks (077)."""
    old = os.umask(mask)
    try:
        tmp = tmp_path / ".out.tmp-x"
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "w.bin").write_bytes(b"\0")
        (tmp / "m.json").write_text("{}")
        for f in (tmp / "sub" / "w.bin", tmp / "m.json"):
            os.chmod(f, 0o600)  # as safetensors.save_file leaves its files
        publish_directory(tmp, tmp_path / "out")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert _mode(out / "m.json") == _mode(out / "sub" / "w.bin") == file_mode
    assert _mode(out) == _mode(out / "sub") == dir_mode


def _step(series: CheckpointSeries, step: int, complete: bool = True) -> Path:
    path = series.step_dir(step)
    path.mkdir(parents=True)
    if complete:
        (path / series.marker).write_text("{}")
    return path


def test_latest_follows_the_pointer_and_skips_incomplete_directories(tmp_path: Path):
    series = CheckpointSeries(tmp_path / "checkpoints", marker="manifest.json")
    assert series.latest() is None
    four = _step(series, 4)
    _step(series, 8, complete=False)  # e.g. damaged by hand
    assert series.latest() == four  # no pointer: the highest complete step
    series.mark_latest(four)
    assert (series.root / "latest").read_text() == "step-00000004\n"
    _step(series, 12)
    assert series.latest() == four  # the pointer wins over a newer directory
    (series.root / "latest").write_text("step-00000008\n")
    assert series.latest() == series.step_dir(12)  # the pointer names an incomplete one
    assert series.step_dir(123456789).name == "step-123456789"
    big = _step(series, 123456789)
    assert series.complete()[-1] == big  # ordered by step number, not by name


def test_prune_keeps_the_newest_and_removes_crash_leftovers(tmp_path: Path):
    series = CheckpointSeries(tmp_path, marker="state.json")
    steps = [_step(series, s) for s in (1, 2, 3, 4)]
    (tmp_path / ".step-00000005.tmp-ab12cd34").mkdir()
    (tmp_path / ".step-00000004.old-ab12cd34").mkdir()
    (tmp_path / ".latest.tmp-4242-ab12cd34").write_text("step-00000005\n")  # killed mid-rename
    series.prune(keep_last=2)
    assert series.complete() == steps[2:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    series.prune(keep_last=0)  # 0 keeps every checkpoint
    assert series.complete() == steps[2:]
