"""Tuning checkpoints: only the prompt parameters and their optimizer state, never the base.

`RUN/checkpoints/step-NNNNNNNN/` holds
- `prompt_state.safetensors`: every prompt parameter (names relative to the hook, e.g.
  `prompts.sentiment.weight`, `prompts.qa.mlp.0.weight`) and AdamW's `exp_avg/NAME`,
  `exp_avg_sq/NAME`, `step/NAME`;
- `state.json`: step, method, tasks with `n_virtual`, the base checkpoint and its fingerprint,
  and the run config.

The prompt parameters are replicated over tensor and data parallel ranks and live on the first
pipeline stage, so global rank 0 holds all of them and writes the checkpoint alone. The step
directory is written atomically and `RUN/checkpoints/latest` names it afterwards. Loading
restores each parameter by name, so a p-tuning LSTM's weights come back too (NeMo's
`PromptEncoder.load_state_dict` once skipped them; a test guards this).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tessera.core.checkpoint import CheckpointSeries, atomic_directory
from tessera.tuning.prompts import VirtualPrompts

STATE_FILE = "prompt_state.safetensors"
META_FILE = "state.json"
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


class TuningCheckpointError(ValueError):
    """A tuning checkpoint that does not belong to this run (other base, tasks or method)."""


def tuning_series(run_dir: str | os.PathLike) -> CheckpointSeries:
    """The run's step directories (complete once their `state.json` is in) and `latest`."""
    return CheckpointSeries(Path(run_dir) / "checkpoints", marker=META_FILE)


def latest_tuning_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete tuning checkpoint of a run, or None."""
    return tuning_series(run_dir).latest()


def save_tuning_checkpoint(run_dir: str | os.PathLike, prompts: VirtualPrompts,
                           optimizer: torch.optim.Optimizer, *, step: int,
                           meta: dict[str, Any], keep_last: int) -> Path:
    """Write the prompts and their optimizer state at `step` (call on the rank holding them)."""
    series = tuning_series(run_dir)
    path = series.step_dir(step)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in prompts.named_parameters():
        tensors[name] = p.detach().float().cpu().contiguous()
        for key, value in optimizer.state.get(p, {}).items():
            if key in _MOMENTS:
                tensors[f"{key}/{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    with atomic_directory(path) as tmp:
        save_file(tensors, str(tmp / STATE_FILE), metadata={"format": "pt"})
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
    series.mark_latest(path)
    series.prune(keep_last)
    return path


def read_tuning_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def check_resumable(meta: dict[str, Any], path: Path, expected: dict[str, Any]) -> None:
    """Raise unless the checkpoint's base fingerprint, method and tasks are this run's."""
    for key in ("base_fingerprint", "method", "n_virtual"):
        if meta.get(key) != expected.get(key):
            raise TuningCheckpointError(
                f"cannot resume from {path}: its {key} is {meta.get(key)!r}, this run's is "
                f"{expected.get(key)!r}; use another --output or drop --resume")


def load_tuning_checkpoint(path: str | os.PathLike, prompts: VirtualPrompts | None,
                           optimizer: torch.optim.Optimizer) -> int:
    """Restore prompts and optimizer state (where this rank holds prompts); return the step."""
    path = Path(path)
    step = int(read_tuning_meta(path)["step"])
    if prompts is None:
        return step
    stored = load_file(str(path / STATE_FILE))
    params = dict(prompts.named_parameters())
    missing = sorted(set(params) - set(stored))
    if missing:
        raise TuningCheckpointError(f"{path}: no values for {missing[:4]}; it was saved by "
                                    "another method or encoder")
    with torch.no_grad():
        for name, p in params.items():
            if stored[name].shape != p.shape:
                raise TuningCheckpointError(f"{path}: {name} has shape "
                                            f"{tuple(stored[name].shape)}, expected "
                                            f"{tuple(p.shape)}")
            p.copy_(stored[name])
            # AdamW keeps its step count on the CPU (unless capturable): leave it there.
            state = {k: stored[f"{k}/{name}"].to("cpu" if k == "step" else p.device)
                     for k in _MOMENTS if f"{k}/{name}" in stored}
            if state:
                optimizer.state[p] = state
    return step
