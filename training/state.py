"""Training checkpoints: model weights plus optimizer moments, RNG states and the data position.

A training checkpoint is an ordinary Tessera checkpoint (so `tessera convert`, `evaluate` and
`serve` read it) with a `training/` folder inside:
- `optim-tp{t}-pp{p}.safetensors`: AdamW's `exp_avg/NAME` and `exp_avg_sq/NAME` for every global
  parameter NAME, split by the same sharding rules as the parameter itself, so the optimizer
  resumes under any other layout too;
- `rng-rank{r}.safetensors`: the default and model-parallel RNG states of each global rank,
  restored only when the layout is unchanged (that is what makes resume bit-identical);
- the manifest's `extra.training`: step, consumed samples, optimizer step count, the run config.

Checkpoints live in `RUN/checkpoints/step-NNNNNNNN/`; `RUN/checkpoints/latest` names the newest
complete one and is replaced (atomically) only after that checkpoint is in place, so a crash at
any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tessera.core.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointSeries,
    Manifest,
    load_weights,
    read_manifest,
    save_checkpoint,
    shard_file_name,
)
from tessera.core.model import GPTModel
from tessera.core.parallel.random import tracker
from tessera.core.parallel.sharding import shard_spec, shard_tensor, unshard_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_series(run_dir: str | os.PathLike) -> CheckpointSeries:
    """The run's step directories (complete once their manifest is in) and `latest` pointer."""
    return CheckpointSeries(checkpoint_dir(run_dir), marker=MANIFEST)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    return checkpoint_series(run_dir).latest()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _named_params(models: list[GPTModel], copies: bool = True) -> dict[str, torch.nn.Parameter]:
    """Parameters by global name; `copies=False` leaves out a tied output copy."""
    out: dict[str, torch.nn.Parameter] = {}
    for model in models:
        for local, p in model.named_parameters():
            name = model.global_name(local)
            if copies or name == local:
                out.setdefault(name, p)
    return out


def save_training_checkpoint(run_dir: str | os.PathLike, models: list[GPTModel],
                             optimizer: torch.optim.Optimizer, *, step: int,
                             consumed_samples: int, config: dict[str, Any],
                             tokenizer: str | None, keep_last: int) -> Path:
    """Save everything needed to resume at `step`. Collective over all ranks."""
    g = models[0].groups
    series = checkpoint_series(run_dir)
    target = series.step_dir(step)

    def write_state(tmp: Path) -> None:
        (tmp / "training").mkdir(exist_ok=True)
        if g.dp_rank == 0:
            moments: dict[str, torch.Tensor] = {}
            for name, p in _named_params(models, copies=False).items():
                state = optimizer.state.get(p, {})
                if shard_spec(name, models[0].config).dim is None and g.tp_rank != 0:
                    continue
                for key in MOMENTS:
                    if key in state:
                        moments[f"{key}/{name}"] = state[key].detach().cpu().contiguous()
            save_file(moments, str(tmp / "training" / f"optim-{shard_file_name(g.tp_rank, g.pp_rank)}"))
        rng = {"cpu": torch.get_rng_state()}
        if tracker.get_state() is not None:
            rng["tracker"] = tracker.get_state()
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(tmp / "training" / f"rng-rank{_global_rank():05d}.safetensors"))

    opt_steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    extra = {"training": {"step": step, "consumed_samples": consumed_samples,
                          "optimizer_step": opt_steps, "world_size": _world_size(),
                          "config": config}}
    save_checkpoint(target, models, step=step, tokenizer=tokenizer, extra=extra,
                    write_extra_files=write_state)
    if _global_rank() == 0:
        series.mark_latest(target)
        series.prune(keep_last)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return target


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def load_training_checkpoint(path: Path, models: list[GPTModel],
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore weights, optimizer moments (any layout) and, on the same layout, RNG states.

    Returns the manifest's training record (step, consumed_samples, ...).
    """
    manifest = load_weights(models, path)
    record = manifest.extra.get("training")
    if record is None:
        raise CheckpointError(f"{path} holds no training state (it is a weights-only checkpoint); "
                              "start a new run from it instead of resuming")
    _load_moments(path, manifest, models, optimizer, record["optimizer_step"])
    g = models[0].groups
    same_layout = (manifest.layout.tp, manifest.layout.pp) == (g.tp_size, g.pp_size) and \
        record.get("world_size") == _world_size()
    rng_file = path / "training" / f"rng-rank{_global_rank():05d}.safetensors"
    if same_layout and rng_file.is_file():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        if "tracker" in rng:
            tracker.set_state(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return record


def _load_moments(path: Path, manifest: Manifest, models: list[GPTModel],
                  optimizer: torch.optim.Optimizer, opt_step: int) -> None:
    saved_tp, saved_pp = manifest.layout.tp, manifest.layout.pp
    files = [path / "training" / f"optim-{shard_file_name(t, p)}"
             for p in range(saved_pp) for t in range(saved_tp)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: optimizer state file {missing[0].name} is missing")
    # key -> tp shards in tp order (pp files hold disjoint keys).
    shards: dict[str, list[torch.Tensor]] = {}
    for f in files:
        for key, value in load_file(str(f)).items():
            shards.setdefault(key, []).append(value)
    g, config = models[0].groups, models[0].config
    for name, p in _named_params(models).items():
        state: dict[str, Any] = {}
        for key in MOMENTS:
            parts = shards.get(f"{key}/{name}")
            if parts is None:
                break
            if shard_spec(name, config).dim is None:
                value = parts[0]
            elif saved_tp == g.tp_size:
                value = parts[g.tp_rank]
            else:
                value = shard_tensor(name, unshard_tensors(name, parts, config), config,
                                     g.tp_rank, g.tp_size)
            state[key] = value.to(device=p.device, dtype=p.dtype).clone()
        if len(state) == len(MOMENTS):
            state["step"] = torch.tensor(float(opt_step))
            optimizer.state[p] = state
    # Parameters sharing a global name (a tied output copy) get the embedding's moments.
    for model in models:
        for local, p in model.named_parameters():
            name = model.global_name(local)
            if name != local and p not in optimizer.state:
                source = _named_params(models)[name]
                if source in optimizer.state:
                    optimizer.state[p] = {k: v.clone() for k, v in optimizer.state[source].items()}


def read_training_record(path: Path) -> dict[str, Any]:
    return read_manifest(path).extra.get("training", {})
