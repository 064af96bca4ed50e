"""AdamW's moments of expert banks under expert parallelism (issue 14).

With ep x etp > 1 an expert bank's piece differs between ep / etp peers, which are dp or tp
peers of each other, so the dense rule (dp rank 0 writes, replicated tensors from tp rank 0)
would lose most pieces. Instead each expert-grid rank of expert-data-parallel rank 0 writes its
pieces' moments to `training/optim-experts-ep{e}-etp{t}-pp{p}.safetensors` (`exp_avg/NAME`,
`exp_avg_sq/NAME`), and `training.moments` leaves expert banks out of its own files.

Reading puts a bank's moment back together from those files (`sharding.unshard_tensors`,
ep-major then etp-minor, as the weights) and slices this rank's piece
(`sharding.shard_expert_tensor`), so moments load under any expert layout; a checkpoint saved
without expert parallelism holds the whole replicated moment in the dense files, which is
sliced the same way. Slicing is exact, so resuming on the same layout is bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tessera.core.expert_checkpoint import expert_sharded
from tessera.core.model import GPTModel
from tessera.core.parallel.expert_data_parallel import expert_parallel
from tessera.core.parallel.sharding import shard_expert_tensor, unshard_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")
_FILE = re.compile(r"^optim-experts-ep(\d+)-etp(\d+)-pp(\d+)\.safetensors$")


def expert_moments_file(ep_rank: int, etp_rank: int, pp_rank: int) -> str:
    return f"optim-experts-ep{ep_rank:02d}-etp{etp_rank:02d}-pp{pp_rank:02d}.safetensors"


def collect_expert_moments(models: list[GPTModel], optimizer: Any
                           ) -> tuple[str, dict[str, torch.Tensor]] | None:
    """This rank's expert moments file (name, tensors), or None where it writes none (no
    expert parallelism, or an expert-data-parallel rank other than 0)."""
    g = models[0].groups
    if not expert_parallel(g) or g.edp_rank != 0:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for model in models:
        for local, p in model.named_parameters():
            name = model.global_name(local)
            state = optimizer.state.get(p, {})
            if expert_sharded(name, g) and all(k in state for k in MOMENTS):
                for k in MOMENTS:
                    tensors[f"{k}/{name}"] = state[k].detach().cpu().contiguous()
    return expert_moments_file(g.ep_rank, g.etp_rank, g.pp_rank), tensors


def _global_from_files(path: Path, key: str, config: Any) -> torch.Tensor | None:
    """Moment `key` of an expert bank put back together from the expert files (None when the
    checkpoint has none for it)."""
    pieces = []
    for file in sorted((path / "training").glob("optim-experts-*.safetensors")):
        m = _FILE.match(file.name)
        if m is None:
            continue
        with safe_open(str(file), framework="pt") as handle:
            if key in handle.keys():
                pieces.append(((int(m[1]), int(m[2])), handle.get_tensor(key)))
    if not pieces:
        return None
    return unshard_tensors(key.split("/", 1)[1], [t for _, t in sorted(pieces,
                                                                       key=lambda x: x[0])],
                           config)


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
