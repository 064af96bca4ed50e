"""Prompt tables on disk: what tuning produces and what the server loads.

A prompt table directory holds
- `prompts.safetensors`: one fp32 tensor `(n_virtual, hidden)` per task, named by the task;
- `prompts.json`: format and version, the base checkpoint's path and fingerprint, the model's
  hidden size, each task's template settings and `n_virtual`, the tuning method, and the
  sha256 of `prompts.safetensors`.

`prompts.json` is written last (each file goes to a temporary name, then one rename), so a
directory with a manifest has the weights it describes; a mismatch is reported, never loaded.

A table only makes sense on the base it was tuned on, so the manifest records that base's
fingerprint (`core.fingerprint.base_fingerprint`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tessera.core.checkpoint import read_manifest
from tessera.core.files import atomic_file, save_safetensors, sha256_file
from tessera.core.fingerprint import base_fingerprint

FORMAT = "tessera-prompts"
FORMAT_VERSION = 1
TABLE_FILE = "prompts.safetensors"
MANIFEST_FILE = "prompts.json"


class PromptTableError(ValueError):
    """A prompt table that cannot be used as asked; the message names the directory and why."""


def _replace(directory: Path, name: str, write) -> None:
    """Write `directory/name` through a temporary file and one rename."""
    with atomic_file(directory / name) as tmp:
        write(tmp)


def write_prompt_table(directory: str | os.PathLike, tables: dict[str, torch.Tensor], *,
                       base_checkpoint: str | os.PathLike, tasks: dict[str, dict[str, Any]],
                       method: str, extra: dict[str, Any] | None = None) -> Path:
    """Write `tables` (task -> `(n_virtual, hidden)`) for `base_checkpoint` into `directory`.

    `tasks` holds each task's template settings (`TaskSpec.to_dict()`); other files in
    `directory` (a tuning run's checkpoints, metrics) are left alone.
    """
    directory = Path(directory)
    base = read_manifest(base_checkpoint).model
    for name, t in tables.items():
        if t.ndim != 2 or t.shape[1] != base.hidden_size:
            raise PromptTableError(f"task {name!r}: table of shape {tuple(t.shape)} does not fit "
                                   f"hidden size {base.hidden_size}")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in tables.items()}
    _replace(directory, TABLE_FILE,
             lambda tmp: save_safetensors(tensors, str(tmp), metadata={"format": "pt"}))
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "method": method,
        "base_checkpoint": str(Path(base_checkpoint).resolve()),
        "base_fingerprint": base_fingerprint(base_checkpoint),
        "hidden_size": base.hidden_size,
        "tasks": {name: {**tasks.get(name, {}), "name": name,
                         "n_virtual": int(tensors[name].shape[0])} for name in tensors},
        "sha256": sha256_file(directory / TABLE_FILE), **(extra or {}),
    }
    _replace(directory, MANIFEST_FILE,
             lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n"))
    return directory


def read_prompt_table(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The manifest and the tables of one prompt table directory, checked for integrity."""
    directory = Path(directory)
    file = directory / MANIFEST_FILE
    if not file.is_file():
        raise PromptTableError(f"{directory} is not a prompt table: {MANIFEST_FILE} is missing "
                               "(make one with `tessera tune` or `tessera tune --import-peft`)")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise PromptTableError(f"{file} is not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise PromptTableError(f"{file}: format {manifest.get('format')!r} version "
                               f"{manifest.get('format_version')!r}, expected {FORMAT!r} "
                               f"version {FORMAT_VERSION}")
    weights = directory / TABLE_FILE
    if not weights.is_file() or sha256_file(weights) != manifest.get("sha256"):
        raise PromptTableError(f"{weights} is missing or does not match {MANIFEST_FILE} (an "
                               "interrupted write?); tune or import the table again")
    with safe_open(str(weights), framework="pt") as handle:
        tables = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    if set(tables) != set(manifest.get("tasks", {})):
        raise PromptTableError(f"{directory}: the manifest lists tasks "
                               f"{sorted(manifest.get('tasks', {}))}, the weights hold "
                               f"{sorted(tables)}")
    return manifest, tables


def check_base(manifest: dict[str, Any], directory: str | os.PathLike,
               base_checkpoint: str | os.PathLike) -> None:
    """Raise `PromptTableError` unless the table was made for `base_checkpoint`'s weights."""
    want = manifest["base_fingerprint"]
    got = base_fingerprint(base_checkpoint)
    if got != want:
        raise PromptTableError(
            f"prompt table {directory} was tuned for the base {manifest['base_checkpoint']} "
            f"(fingerprint {want[:12]}), but {base_checkpoint} has different weights "
            f"(fingerprint {got[:12]}); a prompt only works on the model it was tuned on: tune "
            "again on this base, or load the base the table was made for")


def load_prompt_tables(dirs: str | os.PathLike | Iterable[str | os.PathLike],
                       base_checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every task of the prompt tables in `dirs`, as `{task: (n_virtual, hidden) fp32}`.

    This is what the serving engine takes as `tasks`. Raises `PromptTableError` for a table
    made for another base (fingerprint mismatch), a damaged table, or a task name that two
    directories both define.
    """
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for directory in dirs:
        manifest, tables = read_prompt_table(directory)
        check_base(manifest, directory, base_checkpoint)
        for name, table in tables.items():
            if name in out:
                raise PromptTableError(f"task {name!r} is in both {origin[name]} and "
                                       f"{directory}; serve one of them")
            out[name], origin[name] = table.float(), str(directory)
    return out
