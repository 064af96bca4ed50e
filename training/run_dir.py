"""A run's output directory: refuse to mix two runs in it, or clear the old one on request.

A run directory holds what a training or tuning run writes: `checkpoints/` (step directories and
the `latest` pointer), `metrics.jsonl`, `tensorboard/`, and for tuning the prompt table and its
PEFT export. Starting a fresh run over an old one would append to the old metrics, leave
`latest` on the old run's step and let a later `--resume` continue the wrong run, so
`claim_run_dir` allows exactly three cases:
- the directory holds no run: start;
- `--resume`: continue the run that is there (or start, if there is none yet);
- `--overwrite`: delete the old run's files (only those, never anything else in the
  directory, such as a demo's `data/`) and start.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from tessera.core.config import ConfigError

# What `tessera pretrain` writes into its output directory.
PRETRAIN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard")


def previous_run(output: str | os.PathLike, files: Iterable[str]) -> list[str]:
    """The names in `files` that exist in `output` (an empty `checkpoints/` or an empty
    `metrics.jsonl` left by a run that never got to a step does not count)."""
    found = []
    for name in files:
        path = Path(output) / name
        if (path.is_dir() and any(path.iterdir())) or (path.is_file() and path.stat().st_size > 0):
            found.append(name)
    return found


def claim_run_dir(output: str | os.PathLike, *, resume: bool, overwrite: bool,
                  files: Iterable[str] = PRETRAIN_FILES) -> None:
    """Make `output` ready for a new run, a resumed one, or refuse (`ConfigError`).

    Every rank may call this at once: the removal renames each old entry to a unique name
    before deleting it, so concurrent callers never delete each other's work or fail on a
    half-deleted tree, and a crash mid-way leaves either the old entry or nothing.
    """
    files = tuple(files)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues "
                          "the run in the output directory, --overwrite deletes it")
    old = previous_run(output, files)
    if not old or resume:
        return
    if not overwrite:
        raise ConfigError(
            f"the output directory {output} already holds a run ({', '.join(old)}); pass "
            "--resume to continue it, --overwrite to delete it and start over, or choose "
            "another --output")
    for name in old:
        _remove(Path(output) / name)


def _remove(path: Path) -> None:
    trash = path.with_name(f".{path.name}.overwritten-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, trash)
    except FileNotFoundError:  # another rank got there first
        return
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def missing_directories(path: str | os.PathLike) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first: what a run writing there
    would create, for `remove_empty_directories` to take back if the run is refused."""
    missing, current = [], Path(path).absolute()
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


def remove_empty_directories(directories: Iterable[Path]) -> None:
    """Remove each of `directories` (deepest first) that exists and is empty, so a refused or
    failed run leaves no empty directory behind; a non-empty one stays, and so do its parents."""
    for directory in directories:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty (or not ours to remove): keep it and what holds it
            return
