"""A run's output directory: refuse to mix two runs in it, or clear the old one on request.

A run directory holds what a training or tuning run writes: `checkpoints/` (step directories and
the `latest` pointer), `metrics.jsonl`, `tensorboard/`, and for tuning the prompt table and its
PEFT export. Starting a fresh run over an old one would append to the old metrics, leave
`latest` on the old run's step and let a later resume continue the wrong run, so
`claim_run_dir` allows exactly these cases:
- the directory holds no run: start;
- `--resume auto` (the default): continue the run that is there when its latest checkpoint
  records this run's config (so a rank that died and was restarted by the launcher continues
  with no flag changed); start when it holds no complete checkpoint yet (a run that died before
  its first save: nothing to continue, and a finished run always has its final checkpoint);
  refuse a run with another config;
- `--resume true`: continue the run that is there whatever its config (or start, if there is
  none yet);
- `--resume false`: start, refusing a directory that holds a run;
- `--overwrite`: delete the old run's files (only those, never anything else in the
  directory, such as a demo's `data/`) and start.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tessera.core.arg_types import resume_mode
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


def claim_run_dir(output: str | os.PathLike, *, resume: str | bool, overwrite: bool,
                  files: Iterable[str] = PRETRAIN_FILES, latest: Path | None = None,
                  saved_config: Mapping[str, Any] | None = None,
                  config: Mapping[str, Any] | None = None) -> Path | None:
    """Make `output` ready for a new run, a resumed one, or refuse (`ConfigError`); returns the
    checkpoint to resume from (None: start at step 0).

    `resume` is a `--resume` mode (`auto`, `true`, `false`; a bool reads as `true`/`false`).
    `latest` is the output's latest complete checkpoint, `saved_config` the config it records
    and `config` this run's (both as `RunPlan.record`); `auto` continues only when the two match
    outside the `loop` section (logging, saving and resume settings do not change what trains).
    Every rank may call this at once: only `overwrite` removes anything, and it renames each
    old entry to a unique name before deleting it, so concurrent callers never delete each
    other's work or fail on a half-deleted tree, and a crash mid-way leaves either the old
    entry or nothing.
    """
    files, mode = tuple(files), resume_mode(resume)
    if mode == "true" and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues "
                          "the run in the output directory, --overwrite deletes it")
    old = previous_run(output, files)
    if overwrite:
        for name in old:
            _remove(Path(output) / name)
        return None
    if not old:
        return latest
    if mode == "true" or (mode == "auto" and latest is None):
        return latest
    if mode == "auto":
        changed = config_changes(saved_config or {}, config or {})
        if not changed:
            return latest
        raise ConfigError(
            f"the output directory {output} holds a run with another config ({changed}, "
            "saved -> this run's); pass --resume true to continue it with this config, "
            "--overwrite to delete it and start over, or choose another --output")
    raise ConfigError(
        f"the output directory {output} already holds a run ({', '.join(old)}); pass "
        "--resume to continue it, --overwrite to delete it and start over, or choose "
        "another --output")


def config_changes(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """The settings that differ between two recorded configs outside their `loop` section, as
    `section.field: saved -> wanted` (empty when none do)."""
    # As the checkpoint's JSON holds them: tuples read back as lists.
    saved, wanted = (json.loads(json.dumps(dict(c), default=str)) for c in (saved, wanted))
    out = []
    for section in sorted((set(saved) | set(wanted)) - {"loop"}):
        a, b = saved.get(section), wanted.get(section)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{section}: {a!r} -> {b!r}")
    return ", ".join(out)


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
