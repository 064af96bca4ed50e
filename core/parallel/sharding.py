"""The layout rules, written once: how every weight is split over tensor and pipeline ranks.

Every parameter has one *global* name and shape (what a checkpoint stores, independent of any
layout) and one `ShardSpec`. Model building, checkpoint loading under any layout, the converters
and the server all go through `shard_tensor` / `unshard_tensors` and `stage_ids` /
`stage_layers` (which stages a pipeline rank holds follows the `Layout`'s placement), so the
answer to "how is this weight split?" lives here and nowhere else.

Special cases:
- fused QKV `attention.wqkv` is `[q heads; k heads; v heads]` along dim 0; under grouped-query
  attention the three blocks differ in size, and each is split separately so a rank holds its
  own query heads next to its own kv heads;
- fused SwiGLU `feed_forward.w1` is `[gate; up]` along dim 0, each half split separately;
- the vocabulary (token embedding and output projection) is padded with zero rows up to a
  multiple of the tp size before splitting; padding never reaches a checkpoint or a caller.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tessera.core.config import Layout, ModelConfig


@dataclass(frozen=True)
class ShardSpec:
    """`dim` is the split dimension (None: replicated); `parts` are fused blocks along it."""

    dim: int | None
    parts: tuple[int, ...] | None = None  # sizes of fused blocks, each split on its own
    vocab: bool = False  # rows are vocabulary entries: pad to a multiple of tp first


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of `tp_size` (each rank holds an equal slice)."""
    return -(-vocab_size // tp_size) * tp_size


def global_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global parameter name and its unsharded shape, in module order."""
    c, hd = config.hidden_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
    ffn_rows = config.ffn_hidden_size * (2 if config.gated else 1)
    has_norm_bias = config.norm != "rmsnorm"
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, c)}
    if config.position == "learned":
        shapes["pos_embeddings.weight"] = (config.max_position_embeddings, c)

    def linear(prefix: str, out_f: int, in_f: int) -> None:
        shapes[f"{prefix}.weight"] = (out_f, in_f)
        if config.bias:
            shapes[f"{prefix}.bias"] = (out_f,)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"] = (c,)
        if has_norm_bias:
            shapes[f"{prefix}.bias"] = (c,)

    for i in range(config.num_layers):
        norm(f"layers.{i}.attention_norm")
        linear(f"layers.{i}.attention.wqkv", qkv_rows, c)
        linear(f"layers.{i}.attention.wo", c, config.num_heads * hd)
        norm(f"layers.{i}.ffn_norm")
        linear(f"layers.{i}.feed_forward.w1", ffn_rows, c)
        linear(f"layers.{i}.feed_forward.w2", c, config.ffn_hidden_size)
    norm("norm")
    if not config.tied_embeddings:
        shapes["output.weight"] = (config.vocab_size, c)
    return shapes


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of the global model (tied embeddings counted once)."""
    return sum(math.prod(s) for s in global_param_shapes(config).values())


def shard_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How the global parameter `name` is split over the tensor-parallel group."""
    if name in ("tok_embeddings.weight", "output.weight"):
        return ShardSpec(dim=0, vocab=True)
    m = _LAYER.match(name)
    local = m.group(2) if m else name
    hd = config.head_dim
    if local.startswith("attention.wqkv."):
        q, kv = config.num_heads * hd, config.num_kv_heads * hd
        return ShardSpec(dim=0, parts=(q, kv, kv))
    if local.startswith("feed_forward.w1."):
        f = config.ffn_hidden_size
        return ShardSpec(dim=0, parts=(f, f) if config.gated else None)
    if local in ("attention.wo.weight", "feed_forward.w2.weight"):
        return ShardSpec(dim=1)
    # Norms, position embeddings and row-parallel biases (added after the all-reduce).
    return ShardSpec(dim=None)


def local_shape(name: str, config: ModelConfig, tp_size: int) -> tuple[int, ...]:
    """The shape one tensor-parallel rank holds for the global parameter `name`."""
    shape = list(global_param_shapes(config)[name])
    spec = shard_spec(name, config)
    if spec.dim is not None:
        size = padded_vocab_size(shape[0], tp_size) if spec.vocab else shape[spec.dim]
        shape[spec.dim] = size // tp_size
    return tuple(shape)


def shard_tensor(
    name: str, full: torch.Tensor, config: ModelConfig, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's slice of the global tensor `full` (a view where possible, never a copy of all)."""
    spec = shard_spec(name, config)
    if spec.dim is None or (tp_size == 1 and not spec.vocab):
        return full
    if spec.vocab:
        rows = padded_vocab_size(full.shape[0], tp_size) // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, full.shape[0])
        piece = full[start:stop]
        if stop - start < rows:  # the tail rank carries the zero padding
            pad = full.new_zeros((rows - max(stop - start, 0), *full.shape[1:]))
            piece = torch.cat([piece, pad]) if stop > start else pad
        return piece
    blocks = full.split(list(spec.parts), dim=spec.dim) if spec.parts else (full,)
    pieces = [b.chunk(tp_size, dim=spec.dim)[tp_rank] for b in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def _chunk_bounds(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """`[start, stop)` of piece `tp_rank` of `torch.chunk(size, tp_size)` (empty past the end)."""
    step = -(-size // tp_size)
    return min(tp_rank * step, size), min((tp_rank + 1) * step, size)


def shard_row_ranges(name: str, config: ModelConfig, tp_rank: int, tp_size: int,
                     rows: int | None = None) -> list[tuple[int, int, int]]:
    """Which global rows this rank holds, as `(global_start, global_stop, local_start)`.

    The row-range form of `shard_tensor` (tested against it), for streaming a tensor in row
    chunks: local rows `[local_start, local_start + global_stop - global_start)` of the shard
    are global rows `[global_start, global_stop)`. A replicated or column-split (`dim=1`) tensor
    keeps every row; a row-split one (`dim=0`) keeps one slice per fused block, in order; local
    rows no range covers are the vocabulary's zero padding. `rows` is the global row count
    (default: from `global_param_shapes`, or pass it for an FP8 scale of the weight `name`).
    """
    if rows is None:
        rows = global_param_shapes(config)[name][0]
    spec = shard_spec(name, config)
    if spec.dim != 0 or (tp_size == 1 and not spec.vocab):
        return [(0, rows, 0)] if rows else []
    if spec.vocab:
        per_rank = padded_vocab_size(rows, tp_size) // tp_size
        start, stop = tp_rank * per_rank, min((tp_rank + 1) * per_rank, rows)
        return [(start, stop, 0)] if stop > start else []
    out, block_start, local = [], 0, 0
    for size in spec.parts or (rows,):
        lo, hi = _chunk_bounds(size, tp_rank, tp_size)
        if hi > lo:
            out.append((block_start + lo, block_start + hi, local))
            local += hi - lo
        block_start += size
    return out


def shard_columns(name: str, config: ModelConfig, tp_rank: int, tp_size: int, cols: int
                  ) -> tuple[int, int] | None:
    """The global columns `[start, stop)` this rank holds of a column-split (`dim=1`) tensor
    with `cols` columns; None when the columns are not split (every other tensor)."""
    if shard_spec(name, config).dim != 1 or tp_size == 1:
        return None
    return _chunk_bounds(cols, tp_rank, tp_size)


def unshard_tensors(name: str, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The global tensor from the tensor-parallel shards of every rank, in rank order."""
    spec = shard_spec(name, config)
    tp_size = len(shards)
    if spec.dim is None:
        return shards[0]
    if spec.vocab:
        return torch.cat(shards, dim=0)[: config.vocab_size]
    if not spec.parts:
        return torch.cat(shards, dim=spec.dim)
    per_rank = [s // tp_size for s in spec.parts]
    split = [s.split(per_rank, dim=spec.dim) for s in shards]
    return torch.cat([split[r][p] for p in range(len(spec.parts)) for r in range(tp_size)],
                     dim=spec.dim)


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Pipeline stage indices held by pipeline rank `pp_rank`, in the order its chunks run.

    Placement `looped` (1F1B, interleaved): rank r holds stages r, r + pp, r + 2pp, ...
    Placement `v` (ZBV, DualPipeV; two chunks): rank r holds stages r and 2pp - 1 - r, so the
    first and the last stage share rank 0.
    """
    pp = layout.pp
    if layout.placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(layout.virtual_stages)]


def stage_owners(layout: Layout) -> list[int]:
    """The pipeline rank that holds each stage, indexed by stage id."""
    owners = [0] * layout.num_stages
    for p in range(layout.pp):
        for s in stage_ids(layout, p):
            owners[s] = p
    return owners


def last_stage_pp_rank(layout: Layout) -> int:
    """The pipeline rank that holds the last stage (and so computes the loss)."""
    return stage_owners(layout)[-1]


def stage_layers(stage_id: int, num_stages: int, num_layers: int) -> range:
    """The contiguous global layer indices that pipeline stage `stage_id` holds."""
    per_stage = num_layers // num_stages
    return range(stage_id * per_stage, (stage_id + 1) * per_stage)


def shard_scale(
    name: str, scale: torch.Tensor, config: ModelConfig, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's part of the FP8 scale of weight `name` (see `core.fp8`).

    A per-tensor scale (shape `()`) is whole on every rank. A per-output-channel scale
    (`(out, 1)`) follows the weight's rows: split with them when the weight splits along dim 0,
    whole on every rank when it splits along dim 1 (row-parallel `wo`, `w2`) or not at all.
    """
    if scale.dim() == 0 or shard_spec(name, config).dim != 0:
        return scale
    piece = shard_tensor(name, scale, config, tp_rank, tp_size)
    return piece.masked_fill(piece == 0, 1.0)  # vocabulary padding rows: scale 1, never 0


def unshard_scales(name: str, scales: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The global FP8 scale of weight `name` from every tp rank's part, in rank order."""
    if scales[0].dim() == 0 or shard_spec(name, config).dim != 0:
        return scales[0]
    return unshard_tensors(name, scales, config)
