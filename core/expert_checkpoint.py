"""Checkpoint files of expert banks under expert parallelism.

With ep x etp > 1 the expert banks (`sharding.is_expert_param`) are not in the tensor-parallel
files `model-tp{t}-pp{p}.safetensors`: each expert-grid rank of expert-data-parallel rank 0
writes its piece to `experts-ep{e}-etp{t}-pp{p}.safetensors`, and the weight map lists those
files ep-major, etp-minor (sorted names), which is the order `sharding.unshard_tensors` takes.
A reader of another ep / etp (or none) puts the bank together and slices its own piece
(`sharding.shard_expert_tensor`), so any checkpoint loads under any expert layout. Without
expert parallelism the banks are ordinary replicated tensors (stored once, in tp rank 0's
file), exactly as `core.checkpoint` stores any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from tessera.core.host_copy import host_copy
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import is_expert_param, shard_expert_tensor

if TYPE_CHECKING:
    from tessera.core.checkpoint import CheckpointReader


def expert_sharded(name: str, groups: ParallelGroups) -> bool:
    """Whether parameter `name` is an expert bank split over this rank's expert grid."""
    return groups.ep_size * groups.etp_size > 1 and is_expert_param(name)


def expert_file_name(ep_rank: int, etp_rank: int, pp_rank: int) -> str:
    return f"experts-ep{ep_rank:02d}-etp{etp_rank:02d}-pp{pp_rank:02d}.safetensors"


def stored_in_pieces(name: str, files: list[str]) -> bool:
    """Whether the weight map's `files` for `name` are expert-grid pieces (to put together),
    not whole copies (an expert bank written without expert parallelism, once per tp rank)."""
    return is_expert_param(name) and any(f.startswith("experts-") for f in files)


def write_expert_weights(directory: Path, models: list[nn.Module]) -> dict[str, list[str]]:
    """Write this rank's expert pieces (expert-data-parallel rank 0 only; nothing without
    expert parallelism) into `directory`; return its part of the weight map."""
    found = expert_tensors(models)
    if found is None:
        return {}
    file, keep = found
    save_file(keep, str(directory / file), metadata={"format": "pt"})
    return {n: [file] for n in keep}


def expert_tensors(models: list[nn.Module], *, copy: bool = False
                   ) -> tuple[str, dict[str, torch.Tensor]] | None:
    """This rank's expert file name and the expert pieces it holds, on the host (`copy`: as
    new tensors, see `core.host_copy`); None where the rank writes none."""
    g = models[0].groups
    if g.ep_size * g.etp_size == 1 or g.edp_rank != 0:
        return None
    keep = {n: host_copy(p, copy) for m in models
            for n, p in m.named_parameters() if expert_sharded(n, g)}
    if not keep:
        return None
    return expert_file_name(g.ep_rank, g.etp_rank, g.pp_rank), keep


def read_expert_shard(reader: CheckpointReader, name: str, groups: ParallelGroups
                      ) -> torch.Tensor:
    """This rank's piece of expert bank `name`: its own file when the checkpoint has the same
    ep and etp, otherwise sliced from the whole bank."""
    lay, files = reader.manifest.layout, reader.manifest.weight_map[name]
    ep, etp = groups.ep_size, groups.etp_size
    if (lay.ep, lay.etp) == (ep, etp) and len(files) == ep * etp and stored_in_pieces(
            name, files):
        return reader._dequantized(files[groups.ep_rank * etp + groups.etp_rank], name)
    return shard_expert_tensor(name, reader.global_tensor(name), reader.manifest.model,
                               groups.ep_rank, ep, groups.etp_rank, etp)
