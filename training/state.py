"""Training checkpoints: model weights plus optimizer moments, RNG states and the data position.

A training checkpoint is an ordinary Tessera checkpoint (so `tessera convert`, `evaluate` and
`serve` read it) with a `training/` folder inside:
- `optim-tp{t}-pp{p}-dp{d}.safetensors`: AdamW's `exp_avg/NAME` and `exp_avg_sq/NAME` for every
  global parameter NAME, split by the same sharding rules as the parameter itself and, under
  `zero1` / `fsdp`, into the rows each dp rank owns, with the rows in the file's metadata; so the
  optimizer resumes under any other layout and flavour too (format: `training/moments.py`;
  checkpoints from before it hold `optim-model-tp{t}-pp{p}.safetensors` and still resume);
- `rng-rank{r}.safetensors`: the default and model-parallel RNG states of each global rank,
  restored only when the layout is unchanged (that is what makes resume bit-identical);
- `fp8-rank{r}.safetensors` (`--precision fp8`): the FP8 state of each global rank's layers by
  global layer name (emulated delayed scaling: `NAME.amax_history`, `NAME.scale`), restored on
  resume under any layout when the recipe is the saved one;
- `digests-rank{r}.json` (as in every checkpoint): the sha256 of each file rank r wrote,
  checked on resume; `latest_checkpoint` skips a step whose files do not match;
- the manifest's `extra.training`: step, consumed samples, optimizer step count, the world size,
  `skipped_batches` (the batch ranges the run skips, when it skips any),
  `optimizer` (how the moment files are laid out), `fp8` (the resolved FP8 recipe: backend,
  recipe, format, history length, margin; and the layers left in bf16), the run config.

Under FSDP2 the weights are gathered for the save (each file holds whole tp shards, as always)
and each dp rank loads its own rows back.

Checkpoints live in `RUN/checkpoints/step-NNNNNNNN/`; `RUN/checkpoints/latest` names the newest
complete one and is replaced (atomically) only after that checkpoint is in place, so a crash at
any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from tessera.core.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointReader,
    CheckpointSeries,
    CheckpointWrite,
    Manifest,
    load_weights,
    prepare_checkpoint,
    publish_checkpoint,
    read_manifest,
    verify_files,
)
from tessera.core.fp8_recipe import Fp8Recipe
from tessera.core.fp8_training import Fp8Training
from tessera.core.host_copy import host_copy
from tessera.core.parallel.random import load_rank_rng_states, rank_rng_states
from tessera.core.parallel.zero import ShardedOptimizer, row_range
from tessera.training.expert_moments import collect_expert_moments
from tessera.training.moments import collect_moments, load_moments, optimizer_record


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_series(run_dir: str | os.PathLike) -> CheckpointSeries:
    """The run's step directories (complete once their manifest is in) and `latest` pointer."""
    return CheckpointSeries(checkpoint_dir(run_dir), marker=MANIFEST)


def latest_checkpoint(run_dir: str | os.PathLike, *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint of a run whose files match the sha256 recorded when they
    were written (`verify`; this reads the newest checkpoint once, and an older one only when a
    newer one is damaged), or None. A damaged one is skipped with a warning naming the file."""
    return checkpoint_series(run_dir).latest(_verifies if verify else None)


def _verifies(path: Path) -> bool:
    try:
        verify_files(path, "skipped; delete it or restore it from a copy")
    except CheckpointError as exc:
        if _global_rank() == 0:
            print(f"warning: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_training_checkpoint(run_dir: str | os.PathLike, models: list[nn.Module],
                             optimizer: torch.optim.Optimizer, *, step: int,
                             consumed_samples: int, config: dict[str, Any],
                             tokenizer: str | None, keep_last: int,
                             fp8: Fp8Training | None = None,
                             skipped_batches: list[list[int]] | None = None) -> Path:
    """Save everything needed to resume at `step` (with `fp8`, its recipe and state too;
    `skipped_batches`: the `[start, stop)` batch ranges the run never trains on, see
    `bad_steps.DataWindows`), and point `latest` at it. Collective over all ranks."""
    pending = prepare_training_checkpoint(
        run_dir, models, optimizer, step=step, consumed_samples=consumed_samples,
        config=config, tokenizer=tokenizer, fp8=fp8, skipped_batches=skipped_batches)
    pending.write()
    return publish_training_checkpoint(run_dir, pending, keep_last)


def prepare_training_checkpoint(run_dir: str | os.PathLike, models: list[nn.Module],
                                optimizer: torch.optim.Optimizer, *, step: int,
                                consumed_samples: int, config: dict[str, Any],
                                tokenizer: str | None, fp8: Fp8Training | None = None,
                                skipped_batches: list[list[int]] | None = None,
                                copy: bool = False) -> CheckpointWrite:
    """This rank's part of the training checkpoint at `step`, taken now (`copy`: as host
    copies that the next steps do not change, the only part of an asynchronous save that
    holds up the step), to be written by `CheckpointWrite.write` (no collective; any thread)
    and published by `publish_training_checkpoint`. Collective over all ranks."""
    target = checkpoint_series(run_dir).step_dir(step)
    sharded = isinstance(optimizer, ShardedOptimizer)
    opt_steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    if dist.is_available() and dist.is_initialized():  # a dp rank may hold no state at all
        steps = torch.tensor(opt_steps)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        opt_steps = int(steps)
    g = models[0].groups
    record = optimizer_record(sharded, models[0].train_schedule.data_parallel, g.dp_cp_size)
    extra = {"training": {"step": step, "consumed_samples": consumed_samples,
                          "optimizer_step": opt_steps, "world_size": _world_size(),
                          "optimizer": record, "config": config}}
    if fp8 is not None:
        extra["training"]["fp8"] = fp8.record()
    if skipped_batches:
        extra["training"]["skipped_batches"] = skipped_batches
    with gathered_parameters(models) as gathered:  # FSDP2: whole tp shards, as files hold
        # Gathered parameters are freed on leaving: the writer needs copies of them.
        pending = prepare_checkpoint(target, models, step=step, tokenizer=tokenizer,
                                     extra=extra, copy=copy or gathered)
    for found in (collect_moments(models, optimizer, sharded=sharded),
                  collect_expert_moments(models, optimizer)):  # experts: expert parallelism only
        if found is not None:
            file, tensors, meta = found
            pending.add(f"training/{file}",
                        {k: host_copy(t, copy) for k, t in tensors.items()}, meta)
    pending.add(f"training/rng-rank{_global_rank():05d}.safetensors", rank_rng_states())
    if fp8 is not None:
        pending.add(f"training/fp8-rank{_global_rank():05d}.safetensors",
                    {k: host_copy(t, copy) for k, t in fp8.state_tensors().items()})
    if copy and torch.cuda.is_available():
        torch.cuda.synchronize()  # the pinned host copies are complete
    return pending


def publish_training_checkpoint(run_dir: str | os.PathLike, pending: CheckpointWrite,
                                keep_last: int) -> Path:
    """Publish a written training checkpoint (`publish_checkpoint`), point `latest` at it and
    prune the run's older ones. Collective over all ranks, each after its own write."""
    series = checkpoint_series(run_dir)
    target = publish_checkpoint(pending)
    if _global_rank() == 0:
        series.mark_latest(target)
        series.prune(keep_last)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return target


@contextmanager
def gathered_parameters(models: list[nn.Module]) -> Iterator[bool]:
    """Inside, FSDP2 modules hold whole (unsharded) parameters; a no-op for any other model.
    Yields whether any parameter was gathered (their whole storage is freed on leaving).

    Collective over the dp group: every dp rank enters it together.
    """
    from torch.distributed.fsdp import FSDPModule

    wrapped = [m for model in models for m in model.modules() if isinstance(m, FSDPModule)]
    for m in wrapped:
        m.unshard()
    try:
        yield bool(wrapped)
    finally:
        for m in wrapped:
            m.reshard()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def load_training_checkpoint(path: Path, models: list[nn.Module],
                             optimizer: torch.optim.Optimizer,
                             fp8: Fp8Training | None = None, *,
                             verify: bool = True) -> dict[str, Any]:
    """Restore weights, optimizer moments (any layout), the FP8 state (any layout, same
    recipe) and, on the same layout, RNG states.

    `verify`: first check every file against its recorded sha256 (`verify_files`; one full
    read), raising `CheckpointError` naming a damaged file. Returns the manifest's training
    record (step, consumed_samples, ...).
    """
    if verify:
        earlier = [p.name for p in CheckpointSeries(path.parent).complete() if p.name < path.name]
        verify_files(path, f"resume from an earlier step ({', '.join(earlier[-3:]) or 'none'}"
                           f" in {path.parent}) or delete {path.name}")
    manifest = _load_weights(models, path)
    record = manifest.extra.get("training")
    if record is None:
        raise CheckpointError(f"{path} holds no training state (it is a weights-only checkpoint); "
                              "start a new run from it instead of resuming")
    load_moments(path, manifest, record, models, optimizer)
    g = models[0].groups
    # RNG states belong to ranks: restored only when every rank holds the same stages as when
    # they were saved (dp follows from the world size; a version-1 manifest reads as looped).
    saved, now = manifest.layout, models[0].layout
    same_layout = (saved.tp, saved.cp, saved.pp, saved.virtual_stages, saved.placement) == (
        g.tp_size, g.cp_size, g.pp_size, now.virtual_stages, now.placement) and \
        record.get("world_size") == _world_size()
    if fp8 is not None:
        load_fp8_state(path, record, fp8)
    rng_file = path / "training" / f"rng-rank{_global_rank():05d}.safetensors"
    if same_layout and rng_file.is_file():
        load_rank_rng_states(load_file(str(rng_file)))
    return record


def load_fp8_state(path: Path, record: dict[str, Any], fp8: Fp8Training) -> None:
    """Restore `fp8`'s state from the checkpoint's `fp8-rank*.safetensors` (see
    `restore_fp8_state`). Names are global, so every file is read (this rank's own last, so it
    wins where ranks hold different values of the same layer: per-rank scales); that works
    under any layout."""
    own = path / "training" / f"fp8-rank{_global_rank():05d}.safetensors"
    files = [f for f in sorted((path / "training").glob("fp8-rank*.safetensors")) if f != own]
    restore_fp8_state(fp8, record.get("fp8"), [*files, own], str(path))


def restore_fp8_state(fp8: Fp8Training, saved: dict[str, Any] | None, files: list[Path],
                      source: str) -> None:
    """Load `fp8`'s state from `files` (later ones win) when `saved`, the recipe record of the
    checkpoint, is this run's recipe; after any other precision or recipe the FP8 state starts
    afresh (as in a new run), and the log says so."""
    if saved is None or Fp8Recipe.from_dict(saved) != fp8.recipe:
        if _global_rank() == 0:
            was = "no FP8" if saved is None else Fp8Recipe.from_dict(saved).describe()
            print(f"resume: {source} was saved with {was}; the FP8 scaling state starts afresh "
                  f"for {fp8.recipe.describe()}", flush=True)
        return
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.is_file():
            tensors.update(load_file(str(file)))
    fp8.load_state_tensors(tensors, source)


@torch.no_grad()
def _load_weights(models: list[nn.Module], path: Path) -> Manifest:
    """`load_weights`, also into FSDP2 parameters (each dp rank fills its own rows)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for m in models for p in m.parameters()):
        return load_weights(models, path)
    reader = CheckpointReader(path)
    for model in models:
        g = model.groups
        for local, p in model.named_parameters():
            if local.startswith("embedding_hook."):
                continue
            value = reader.shard(model.global_name(local), g.tp_rank, g.tp_size)
            if value.shape != p.shape:
                raise CheckpointError(f"{path}: tensor {model.global_name(local)} has shape "
                                      f"{tuple(value.shape)}, the model expects {tuple(p.shape)}")
            if isinstance(p, DTensor):
                start, stop = row_range(p.shape[0], g.dp_cp_rank, g.dp_cp_size)
                p.to_local().copy_(value[start:stop])
            else:
                p.copy_(value.to(p.dtype))
    return reader.manifest


def read_training_record(path: Path) -> dict[str, Any]:
    return read_manifest(path).extra.get("training", {})
