"""AdamW's moments of expert banks under expert parallelism.

With ep x etp > 1 an expert bank's piece differs between ep / etp peers, which are dp or tp
peers of each other, so the dense rule (dp rank 0 writes, replicated tensors from tp rank 0)
would lose most pieces. Instead each expert-grid rank of expert-data-parallel rank 0 writes its
pieces' moments to `training/optim-experts-ep{e}-etp{t}-pp{p}.safetensors` (`exp_avg/NAME`,
`exp_avg_sq/NAME`), and `training.moments` leaves expert banks out of its own files. Under
`zero1` with an expert-data-parallel group larger than 1, each edp rank holds only its rows of
the pieces' moments (`core.parallel.zero`), so every edp rank d writes them, to
`optim-experts-ep{e}-etp{t}-pp{p}-edp{d}.safetensors`. Every file's metadata `moments` is a
JSON object `{NAME: [start, stop, rows]}`: its tensors are rows `start:stop` of dim 0 (of
`rows`) of the piece (files without it hold whole pieces).

Reading joins each piece's rows (`moment_rows.join_rows`), puts a bank's moment back together
from the pieces (`sharding.unshard_tensors`, ep-major then etp-minor, as the weights) and
slices this rank's piece (`sharding.shard_expert_tensor`), so moments load under any expert
layout and data-parallel flavour; a checkpoint saved without expert parallelism holds the whole
replicated moment in the dense files, which is sliced the same way. Slicing is exact, so
resuming on the same layout is bit for bit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tessera.core.expert_checkpoint import expert_sharded
from tessera.core.parallel.expert_data_parallel import expert_parallel
from tessera.core.parallel.sharding import shard_expert_tensor, unshard_tensors
from tessera.core.parallel.zero import ShardedOptimizer
from tessera.training.moment_rows import join_rows, optimizer_slots

MOMENTS = ("exp_avg", "exp_avg_sq")
_FILE = re.compile(r"^optim-experts-ep(\d+)-etp(\d+)-pp(\d+)(?:-edp(\d+))?\.safetensors$")


def expert_moments_file(ep_rank: int, etp_rank: int, pp_rank: int,
                        edp_rank: int | None = None) -> str:
    """The file of one expert-grid rank's moments; `edp_rank` given: its rows under zero1."""
    edp = "" if edp_rank is None else f"-edp{edp_rank:02d}"
    return f"optim-experts-ep{ep_rank:02d}-etp{etp_rank:02d}-pp{pp_rank:02d}{edp}.safetensors"


def collect_expert_moments(models: list[nn.Module], optimizer: Any
                           ) -> tuple[str, dict[str, torch.Tensor], dict[str, str]] | None:
    """This rank's expert moments file (name, tensors, metadata), or None where it writes none
    (no expert parallelism, or, unless zero1 splits the rows over edp, an expert-data-parallel
    rank other than 0)."""
    g = models[0].groups
    split = isinstance(optimizer, ShardedOptimizer) and g.edp_size > 1
    if not expert_parallel(g) or (g.edp_rank != 0 and not split):
        return None
    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, list[int]] = {}
    for name, key, start, stop, total in optimizer_slots(models, optimizer):
        state = optimizer.state.get(key, {})
        if expert_sharded(name, g) and all(k in state for k in MOMENTS):
            rows[name] = [start, stop, total]
            for k in MOMENTS:
                tensors[f"{k}/{name}"] = state[k].detach().cpu().contiguous()
    file = expert_moments_file(g.ep_rank, g.etp_rank, g.pp_rank, g.edp_rank if split else None)
    return file, tensors, {"format": "pt", "moments": json.dumps(rows)}


def _global_from_files(path: Path, key: str, config: Any) -> torch.Tensor | None:
    """Moment `key` of an expert bank put back together from the expert files (None when the
    checkpoint has none for it): each piece from its row files, then the pieces."""
    name = key.split("/", 1)[1]
    rows: dict[tuple[int, int], list[tuple[int, int, int, Any]]] = {}
    for file in sorted((path / "training").glob("optim-experts-*.safetensors")):
        m = _FILE.match(file.name)
        if m is None:
            continue
        with safe_open(str(file), framework="pt") as handle:
            if key not in handle.keys():
                continue
            t = handle.get_tensor(key)
            saved = json.loads((handle.metadata() or {}).get("moments", "{}")).get(name)
        start, stop, total = saved or (0, t.shape[0], t.shape[0])
        rows.setdefault((int(m[1]), int(m[2])), []).append((start, stop, total, lambda t=t: t))
    if not rows:
        return None
    pieces = [join_rows(rows[k], f"{path}: expert optimizer state {key} (ep, etp {k})")
              for k in sorted(rows)]
    return unshard_tensors(name, pieces, config)


def expert_moment(path: Path, key: str, name: str, config: Any, groups: Any,
                  dense: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """This rank's piece of moment `key` of expert bank `name`: from the expert files, or else
    `dense()` (the whole moment saved without expert parallelism), sliced to this rank's
    expert-grid piece; None when the checkpoint has no such moment."""
    full = _global_from_files(path, key, config)
    if full is None:
        full = dense()
    if full is None or not expert_sharded(name, groups):
        return full
    return shard_expert_tensor(name, full, config, groups.ep_rank, groups.ep_size,
                               groups.etp_rank, groups.etp_size)


def global_expert_moments(path: Path, config: Any) -> dict[str, torch.Tensor]:
    """Every expert moment saved in expert files, as global tensors `{"exp_avg/NAME": t}`."""
    keys: set[str] = set()
    for file in (path / "training").glob("optim-experts-*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            keys.update(handle.keys())
    return {k: _global_from_files(path, k, config) for k in sorted(keys)}
