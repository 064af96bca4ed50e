"""Tuning checkpoints: only the prompt parameters and their optimizer state, never the base.

`RUN/checkpoints/step-NNNNNNNN/` holds
- `prompt_state.safetensors`: every prompt parameter (names relative to the hook, e.g.
  `prompts.sentiment.weight`, `prompts.qa.mlp.0.weight`) and AdamW's `exp_avg/NAME`,
  `exp_avg_sq/NAME`, `step/NAME`;
- `state.json`: step, method, tasks with `n_virtual`, the base checkpoint and its fingerprint,
  and the run config;
- under `--data-parallel zero1|fsdp` (dp > 1), the moments are not in `prompt_state` but in
  `prompt_optim-dp{d}.safetensors`, one per dp rank, each with the rows `start:stop` (of
  `rows`) of dim 0 it owns in its metadata (`moments`: `{NAME: [start, stop, rows]}`), and
  `state.json` has `optimizer: {"format": 2, "dp_files": D}`; any dp and flavour resumes them;
- under `--precision fp8`, `fp8_state.safetensors`: the frozen base's FP8 scaling state (amax
  histories and scales by global layer name, gathered from every stage), and the recipe in
  `state.json` (`fp8`), restored on resume like a training checkpoint's.

The prompt parameters are replicated over tensor and data parallel ranks and live on the first
pipeline stage, so global rank 0 holds all of them and writes the checkpoint alone (with a
sharded optimizer every rank joins the save, see `save_tuning_checkpoint`). The step
directory is written atomically and `RUN/checkpoints/latest` names it afterwards. Loading
restores each parameter by name, so a p-tuning LSTM's weights come back too (NeMo's
`PromptEncoder.load_state_dict` once skipped them; a test guards this).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tessera.core.checkpoint import (
    CheckpointSeries,
    atomic_directory,
    publish_directory,
    temp_sibling,
)
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.zero import ShardedOptimizer
from tessera.core.prompts import VirtualPrompts
from tessera.training.moments import join_rows

STATE_FILE = "prompt_state.safetensors"
META_FILE = "state.json"
OPTIM_FILE = "prompt_optim-dp{dp:02d}.safetensors"  # zero1 / fsdp: dp rank's moment rows
FP8_FILE = "fp8_state.safetensors"  # --precision fp8: the base's FP8 scaling state
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


class TuningCheckpointError(ValueError):
    """A tuning checkpoint that does not belong to this run (other base, tasks or method)."""


def tuning_series(run_dir: str | os.PathLike) -> CheckpointSeries:
    """The run's step directories (complete once their `state.json` is in) and `latest`."""
    return CheckpointSeries(Path(run_dir) / "checkpoints", marker=META_FILE)


def latest_tuning_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete tuning checkpoint of a run, or None."""
    return tuning_series(run_dir).latest()


def save_tuning_checkpoint(run_dir: str | os.PathLike, prompts: VirtualPrompts | None,
                           optimizer: Any, *, step: int, meta: dict[str, Any], keep_last: int,
                           groups: ParallelGroups | None = None,
                           fp8_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the prompts and their optimizer state at `step` (and `fp8_state`, given on
    global rank 0: the FP8 state of every rank's layers).

    With an ordinary optimizer, call on the rank holding the prompts (global rank 0), alone.
    With a `ShardedOptimizer` (zero1 / fsdp over dp), call on every rank: it is collective, and
    each dp rank holding prompts at tp rank 0 writes the moment rows it owns.
    """
    series = tuning_series(run_dir)
    path = series.step_dir(step)
    if isinstance(optimizer, ShardedOptimizer):
        _save_sharded(series, path, prompts, optimizer, groups, {**meta, "step": step},
                      fp8_state)
    else:
        tensors = _prompt_tensors(prompts, lambda p: optimizer.state.get(p, {}), _MOMENTS)
        with atomic_directory(path) as tmp:
            save_file(tensors, str(tmp / STATE_FILE), metadata={"format": "pt"})
            if fp8_state is not None:
                save_file(fp8_state, str(tmp / FP8_FILE))
            (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
    if not dist.is_initialized() or dist.get_rank() == 0:
        series.mark_latest(path)
        series.prune(keep_last)
    if isinstance(optimizer, ShardedOptimizer) and dist.is_initialized():
        dist.barrier()
    return path


def _prompt_tensors(prompts: VirtualPrompts, state_of: Any, keys: tuple[str, ...]
                    ) -> dict[str, torch.Tensor]:
    """Every prompt parameter, and its optimizer state under `keys`, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in prompts.named_parameters():
        tensors[name] = p.detach().float().cpu().contiguous()
        for key, value in state_of(p).items():
            if key in keys:
                tensors[f"{key}/{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors


def _save_sharded(series: CheckpointSeries, path: Path, prompts: VirtualPrompts | None,
                  optimizer: ShardedOptimizer, groups: ParallelGroups | None,
                  meta: dict[str, Any], fp8_state: dict[str, torch.Tensor] | None) -> None:
    """Rank 0 writes the prompts and their step counts, each dp rank holding prompts at tp
    rank 0 its rows of the moments (`OPTIM_FILE`, rows in the metadata as in a training
    checkpoint), all into one temporary directory that rank 0 then publishes."""
    g = groups or ParallelGroups()
    token = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    tmp = temp_sibling(path, token[0])
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    if prompts is not None and g.tp_rank == 0:
        shards = {id(s.param): s for s in optimizer}
        tensors, rows = {}, {}
        for name, p in prompts.named_parameters():
            s = shards[id(p)]
            state = optimizer.state.get(s.view, {})
            if all(k in state for k in _MOMENTS):
                rows[name] = [s.start, s.stop, s.rows]
                for k in _MOMENTS[:2]:
                    tensors[f"{k}/{name}"] = state[k].detach().cpu().contiguous()
        save_file(tensors, str(tmp / OPTIM_FILE.format(dp=g.dp_rank)),
                  metadata={"format": "pt", "moments": json.dumps(rows)})
        if rank0:
            steps = _prompt_tensors(prompts, lambda p: optimizer.state.get(
                shards[id(p)].view, {}), ("step",))
            save_file(steps, str(tmp / STATE_FILE), metadata={"format": "pt"})
            if fp8_state is not None:
                save_file(fp8_state, str(tmp / FP8_FILE))
            record = {**meta, "optimizer": {"format": 2, "dp_files": g.dp_size}}
            (tmp / META_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        publish_directory(tmp, path)


def read_tuning_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def check_resumable(meta: dict[str, Any], path: Path, expected: dict[str, Any]) -> None:
    """Raise unless the checkpoint's base fingerprint, method, tasks and (LoRA) adapter shape
    are this run's."""
    for key in ("base_fingerprint", "method", "n_virtual", "lora"):
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
    meta = read_tuning_meta(path)
    stored = load_file(str(path / STATE_FILE))
    if "optimizer" in meta:  # moments saved as rows by each dp rank
        stored.update(_joined_moments(path, meta["optimizer"]["dp_files"]))
    params = dict(prompts.named_parameters())
    missing = sorted(set(params) - set(stored))
    if missing:
        raise TuningCheckpointError(f"{path}: no values for {missing[:4]}; it was saved by "
                                    "another method or encoder")
    shards = {id(s.param): s for s in optimizer} if isinstance(optimizer, ShardedOptimizer) \
        else {}
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
            if state and id(p) in shards:  # this dp rank keeps its rows only
                s = shards[id(p)]
                state = {k: v if k == "step" else v[s.start:s.stop].clone()
                         for k, v in state.items()}
                optimizer.state[s.view] = state
            elif state:
                optimizer.state[p] = state
    return step


def _joined_moments(path: Path, dp_files: int) -> dict[str, torch.Tensor]:
    """`{"exp_avg/NAME": tensor}` put together from the row files of every dp rank."""
    pieces: dict[str, list[tuple[int, int, int, Any]]] = {}
    for d in range(dp_files):
        file = path / OPTIM_FILE.format(dp=d)
        if not file.is_file():
            raise TuningCheckpointError(f"{path}: optimizer state file {file.name} is missing")
        handle = safe_open(str(file), framework="pt")
        rows = json.loads(handle.metadata()["moments"])
        for key in handle.keys():
            start, stop, total = rows[key.split("/", 1)[1]]
            pieces.setdefault(key, []).append(
                (start, stop, total, lambda h=handle, k=key: h.get_tensor(k)))
    return {key: join_rows(parts, f"{path}: {key}") for key, parts in pieces.items()}
