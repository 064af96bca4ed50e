"""LoRA tuning checkpoints: the adapter's A/B factors and their AdamW state, never the base.

`RUN/checkpoints/step-NNNNNNNN/` (the series of `tuning.checkpoint`) holds
- `lora_state.safetensors`: every factor under its global name (`MODULE.lora_A.weight`, global
  shape, put together from the tp and pp ranks by the sharding rule), AdamW's `exp_avg/NAME`
  and `exp_avg_sq/NAME` (sharded as their parameter, so stored global too) and `step/NAME`;
- `fp8_state.safetensors` (`--precision fp8`): the FP8 base layers' amax histories and scales;
- `rng.safetensors`: every rank's RNG states (`tuning.rng_state`), so dropout resumes exactly;
- `state.json`: step, method, the adapter (`lora`: rank, alpha, dropout, modules), the base's
  path and fingerprint, and the run config.
Being global, a checkpoint resumes under any tp x pp x dp layout: each rank cuts its pieces.
Saving is collective (every rank sends its pieces to global rank 0, which writes alone). Under
`--data-parallel zero1 / fsdp` (a `ShardedOptimizer`: each dp rank keeps rows of the moments, and
under fsdp of the factors too) the rows are all-gathered over dp first; loading keeps each dp
rank's rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from tessera.core.checkpoint import atomic_directory
from tessera.core.lora import gather_global, lora_parameters
from tessera.core.parallel.sharding import shard_tensor
from tessera.core.parallel.zero import RowShard, ShardedOptimizer
from tessera.tuning.checkpoint import FP8_FILE, META_FILE, TuningCheckpointError, tuning_series
from tessera.tuning.rng_state import gather_rng_states, restore_rng_states, write_rng_states

STATE_FILE = "lora_state.safetensors"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def gather_adapter(stages: list[nn.Module], optimizer: Any | None = None
                   ) -> dict[str, torch.Tensor] | None:
    """The global factors (and, with `optimizer`, their AdamW state) on global rank 0; None on
    the other ranks. Collective."""
    shards = _shards(optimizer)
    local: dict[str, torch.Tensor] = {}
    for name, p in lora_parameters(stages).items():
        shard = shards.get(id(p))
        local[name] = p.full_tensor() if hasattr(p, "full_tensor") else p  # fsdp: collective
        state = {} if optimizer is None else \
            optimizer.state.get(shard.view if shard else p, {})
        for key in (*_MOMENTS, "step"):
            if key in state:
                value = torch.as_tensor(state[key])
                local[f"{key}/{name}"] = _whole_rows(value, shard) \
                    if shard is not None and key != "step" else value
    return gather_global(local, stages[0].groups, stages[0].config)


def _shards(optimizer: Any | None) -> dict[int, RowShard]:
    """The `RowShard` of each parameter (by id) of a sharded optimizer; {} otherwise."""
    return {id(s.param): s for s in optimizer} if isinstance(optimizer, ShardedOptimizer) else {}


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 parameter's local rows (a `DTensor`'s local tensor); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _whole_rows(rows: torch.Tensor, shard: RowShard) -> torch.Tensor:
    """Rows `shard.start:shard.stop` of every rank in `shard.over`, put together (collective
    over that group): each rank sends its rows padded to an equal count."""
    over = shard.over
    if over.group is None or over.size == 1:
        return rows.detach()
    per = -(-shard.rows // over.size)
    padded = rows.new_zeros((per, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows.detach()
    blocks = [torch.empty_like(padded) for _ in range(over.size)]
    dist.all_gather(blocks, padded.contiguous(), group=over.group)
    return torch.cat(blocks)[:shard.rows]


def save_lora_checkpoint(run_dir: str | os.PathLike, stages: list[nn.Module], optimizer: Any,
                         *, step: int, meta: dict[str, Any], keep_last: int,
                         fp8_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the factors, their optimizer state and every rank's RNG states at `step` (and
    `fp8_state`, given on global rank 0: the FP8 state of the base's layers). Call on every
    rank."""
    series = tuning_series(run_dir)
    path = series.step_dir(step)
    tensors = gather_adapter(stages, optimizer)
    rng = gather_rng_states()
    if _rank0():
        with atomic_directory(path) as tmp:
            save_file(tensors, str(tmp / STATE_FILE), metadata={"format": "pt"})
            write_rng_states(tmp, rng, stages[0].groups)
            if fp8_state is not None:
                save_file(fp8_state, str(tmp / FP8_FILE))
            (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
        series.mark_latest(path)
        series.prune(keep_last)
    if dist.is_initialized():
        dist.barrier()
    return path


@torch.no_grad()
def load_lora_checkpoint(path: str | os.PathLike, stages: list[nn.Module],
                         optimizer: torch.optim.Optimizer) -> int:
    """Restore this rank's factor pieces, their optimizer state and (on the layout that saved
    them) its RNG states; return the step."""
    path = Path(path)
    step = int(json.loads((path / META_FILE).read_text())["step"])
    file = path / STATE_FILE
    if not file.is_file():
        raise TuningCheckpointError(f"{path} holds no LoRA state ({STATE_FILE}); it was saved "
                                    "by another method: use another --output or drop --resume")
    stored = load_file(str(file))
    g, config = stages[0].groups, stages[0].config
    shards = _shards(optimizer)
    for name, p in lora_parameters(stages).items():
        if name not in stored:
            raise TuningCheckpointError(f"{path}: no values for {name}; it was saved for "
                                        "other target modules")
        shard = shards.get(id(p))
        rows = slice(shard.start, shard.stop) if shard is not None else slice(None)
        whole = shard_tensor(name, stored[name], config, g.tp_rank, g.tp_size)
        _local(p).copy_(whole[rows] if _local(p) is not p else whole)
        state = {k: shard_tensor(name, stored[f"{k}/{name}"], config, g.tp_rank, g.tp_size)
                 [rows].to(p.device).clone() for k in _MOMENTS if f"{k}/{name}" in stored}
        if state:
            # AdamW keeps its step count on the CPU (unless capturable): leave it there.
            state["step"] = stored[f"step/{name}"].clone()
            optimizer.state[shard.view if shard is not None else p] = state
    restore_rng_states(path, g)
    return step
