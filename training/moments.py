"""AdamW's moments in a training checkpoint: written by every rank that holds some, read by any
layout (other tp, pp, dp, or data-parallel flavour ddp / zero1 / fsdp).

Each writing rank stores `training/optim-tp{t}-pp{p}-dp{d}.safetensors` (two-digit ranks) with
`exp_avg/NAME` and `exp_avg_sq/NAME` for the global parameter names it holds, and in the file's
metadata `moments`: a JSON object `{NAME: [start, stop, rows]}` saying that the tensors are rows
`start:stop` of dim 0 (of `rows`) of tp rank t's shard of NAME (split by the sharding rules of
`core.parallel.sharding`), plus `tp_rank`, `tp_size`. Under `ddp` only dp rank 0 writes, whole
shards (`[0, rows, rows]`); under `zero1` and `fsdp` every dp rank writes the rows it owns
(`core.parallel.zero.row_range`). Replicated parameters are written by tp rank 0 only, and a
tied output copy is never written (it has the embedding's moments). The manifest's
`extra.training.optimizer` = `{"format": 2, "data_parallel": ..., "dp_files": D}` names the
files: one per (tp, pp, dp < D) rank of the saved layout.

Checkpoints written before this format (no `optimizer` record) hold
`training/optim-model-tp{t}-pp{p}.safetensors` with whole tp shards and no metadata; they are
read as `dp_files = 1` with whole rows. Reading reassembles, for each parameter of this rank,
the rows it needs: its own rows of its own shard read from the files that hold them when the
tensor-parallel layout is unchanged (bit-exact), or else the global tensor, re-split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tessera.core.checkpoint import CheckpointError, Manifest
from tessera.core.expert_checkpoint import expert_sharded
from tessera.core.parallel.sharding import (
    is_expert_param,
    shard_spec,
    shard_tensor,
    unshard_tensors,
)
from tessera.training.expert_moments import expert_moment, global_expert_moments
from tessera.training.moment_rows import join_rows, optimizer_slots

MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = 2


def moments_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim-tp{tp_rank:02d}-pp{pp_rank:02d}-dp{dp_rank:02d}.safetensors"


def _legacy_file(tp_rank: int, pp_rank: int) -> str:
    return f"optim-model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def collect_moments(models: list[nn.Module], optimizer: Any, *, sharded: bool
                    ) -> tuple[str, dict[str, torch.Tensor], dict[str, str]] | None:
    """This rank's moments file: (file name, tensors, metadata), or None where it writes none
    (`sharded=False`, ddp: only dp rank 0 writes). Call before FSDP2 modules are unsharded.
    The optimizer shards over dp x cp (`ParallelGroups.dp_cp_rank`, the dp rank when cp is 1):
    that index is the file's `dp` number."""
    g, config = models[0].groups, models[0].config
    if not sharded and g.dp_cp_rank != 0:
        return None
    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, list[int]] = {}
    for name, key, start, stop, total in optimizer_slots(models, optimizer):
        if name in rows or (shard_spec(name, config).dim is None and g.tp_rank != 0):
            continue  # a tied copy (same global name), or a replica another tp rank writes
        if expert_sharded(name, g):
            continue  # an expert-grid piece: `expert_moments` writes it
        state = optimizer.state.get(key, {})
        if not all(k in state for k in MOMENTS):
            continue
        rows[name] = [start, stop, total]
        for k in MOMENTS:
            tensors[f"{k}/{name}"] = state[k].detach().cpu().contiguous()
    meta = {"format": "pt", "moments": json.dumps(rows), "tp_rank": str(g.tp_rank),
            "tp_size": str(g.tp_size)}
    return moments_file(g.tp_rank, g.pp_rank, g.dp_cp_rank), tensors, meta


def optimizer_record(sharded: bool, data_parallel: str, dp_size: int) -> dict[str, Any]:
    """The manifest's `extra.training.optimizer`: how the moment files are laid out."""
    return {"format": FORMAT, "data_parallel": data_parallel,
            "dp_files": dp_size if sharded else 1}


class _Pieces:
    """The saved moment pieces of a checkpoint: (key, tp rank) -> [(start, stop, rows, file)]."""

    def __init__(self, path: Path, manifest: Manifest, record: dict[str, Any]) -> None:
        layout, opt = manifest.layout, record.get("optimizer")
        self.saved_tp = layout.tp
        self.pieces: dict[tuple[str, int], list[tuple[int, int, int, Any]]] = {}
        folder = path / "training"
        if opt is None:  # written before format 2: whole tp shards, named by (tp, pp)
            files = [(t, folder / _legacy_file(t, p)) for p in range(layout.pp)
                     for t in range(layout.tp)]
        else:
            if opt.get("format") != FORMAT:
                raise CheckpointError(f"{path}: optimizer state format {opt.get('format')} is "
                                      f"not supported (this Tessera reads {FORMAT})")
            files = [(t, folder / moments_file(t, p, d)) for p in range(layout.pp)
                     for d in range(opt["dp_files"]) for t in range(layout.tp)]
        for tp_rank, file in files:
            if not file.is_file():
                raise CheckpointError(f"{path}: optimizer state file {file.name} is missing")
            handle = safe_open(str(file), framework="pt")
            ranges = json.loads((handle.metadata() or {}).get("moments", "null") or "null")
            for key in handle.keys():
                name = key.split("/", 1)[1]
                if ranges is None:
                    n = handle.get_slice(key).get_shape()[0]
                    start, stop, total = 0, n, n
                else:
                    start, stop, total = ranges[name]
                self.pieces.setdefault((key, tp_rank), []).append((start, stop, total, handle))

    def shard(self, key: str, tp_rank: int) -> torch.Tensor | None:
        """The whole tp shard `tp_rank` of moment `key`, from its row pieces (None if absent)."""
        parts = self.pieces.get((key, tp_rank))
        if not parts:
            return None
        return join_rows([(a, b, n, lambda h=h: h.get_tensor(key)) for a, b, n, h in parts],
                         f"optimizer state {key} (tp rank {tp_rank})")


def load_moments(path: Path, manifest: Manifest, record: dict[str, Any], models: list[nn.Module],
                 optimizer: Any) -> None:
    """Fill `optimizer.state` for this rank's parameters from the checkpoint at `path`."""
    g, config = models[0].groups, models[0].config
    pieces = _Pieces(path, manifest, record)
    step = torch.tensor(float(record["optimizer_step"]))
    cache: dict[tuple[str, str], torch.Tensor | None] = {}

    def my_shard(key: str, name: str) -> torch.Tensor | None:
        if (key, name) not in cache:  # a tied copy reads the same shard again
            if is_expert_param(name):  # expert parallelism may have saved or may want pieces
                value = expert_moment(path, key, name, config, g,
                                      lambda: pieces.shard(key, 0))
            elif shard_spec(name, config).dim is None:
                value = pieces.shard(key, 0)
            elif pieces.saved_tp == g.tp_size:
                value = pieces.shard(key, g.tp_rank)
            else:
                parts = [pieces.shard(key, t) for t in range(pieces.saved_tp)]
                value = None if any(p is None for p in parts) else shard_tensor(
                    name, unshard_tensors(name, parts, config), config, g.tp_rank, g.tp_size)
            cache[(key, name)] = value
        return cache[(key, name)]

    for name, slot, start, stop, total in optimizer_slots(models, optimizer):
        state: dict[str, Any] = {}
        for k in MOMENTS:
            value = my_shard(f"{k}/{name}", name)
            if value is None:
                break
            if value.shape[0] != total:
                raise CheckpointError(f"{path}: optimizer state {k}/{name} has {value.shape[0]} "
                                      f"rows, the model's shard has {total}")
            state[k] = value[start:stop].to(device=slot.device, dtype=slot.dtype).clone()
        if len(state) == len(MOMENTS):
            state["step"] = step.clone()
            optimizer.state[slot] = state


def read_global_moments(path: str | Path) -> dict[str, torch.Tensor]:
    """Every saved moment as its global (unsharded) tensor, `{"exp_avg/NAME": tensor}`: the
    rows and tensor-parallel shards of any saved layout put back together."""
    from tessera.core.checkpoint import read_manifest

    path = Path(path)
    manifest = read_manifest(path)
    pieces = _Pieces(path, manifest, manifest.extra.get("training", {}))
    config, out = manifest.model, {}
    for key in sorted({k for k, _ in pieces.pieces}):
        name = key.split("/", 1)[1]
        if shard_spec(name, config).dim is None:
            out[key] = pieces.shard(key, 0)
        else:
            parts = [pieces.shard(key, t) for t in range(pieces.saved_tp)]
            out[key] = unshard_tensors(name, parts, config)
    out.update(global_expert_moments(path, config))  # expert parallelism: their own files
    return out
