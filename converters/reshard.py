"""Rewrite a Tessera checkpoint for another layout, dtype or FP8, in bounded row chunks.

`reshard_checkpoint(src, dst, tp=..., pp=...)` writes `dst` so that each rank (t, p) of the
target layout finds everything it holds in its own file `model-tp{t}-pp{p}.safetensors`, with
the manifest and weight map format of `core.checkpoint`. Replicated tensors (norms, position
embeddings, row-parallel biases) get a copy in every tp rank's file; only the last stage of a
tied-embedding model also reads the first stage's file, where the shared embedding is stored
once. Which tensors a rank holds, and how each is sliced, come from the one-place rules: the
model's own stage structure (`stored_parameters` of meta-device model chunks) and
`core.parallel.sharding`.

Memory: no tensor is ever held whole. Each is streamed in row chunks of `CHUNK_BYTES` (32 MiB):
global rows `[r0, r1)` are read from the row ranges of the source shards that hold them (plain
file reads, no memory map) and written to the rows, or for a column split the columns of the
same rows, of the target shards, all target files open together with their headers written
first (names, dtypes and shapes follow from the layout). The row ranges come from
`core.parallel.sharding.shard_row_ranges` / `shard_columns`, the row-range form of
`shard_tensor`. Peak memory is a few chunks (reused buffers: the rows read, a cast copy, a
target's columns; FP8 quantization adds its fp32 temporaries), whatever the model's or the
largest tensor's size: a 1.28 GB fp32 checkpoint (largest tensor the 262 MB embedding) reshards
from tp 1 to tp 2 x pp 2, tp 1 or tp 4 with a peak of 37-54 MB above the interpreter's baseline,
3-4% of its size (`bench/bench_convert.py`), 63 MB casting to bf16 and 124 MB (10%) quantizing
to FP8; the CPU time is a fraction of a second, the rest is file I/O.

Mixture-of-Experts expert banks stream expert by expert instead, between whole banks and the
expert-grid pieces of any ep x etp on either side (`converters.expert_reshard`), within the
same few chunks.

Exactness: slicing and concatenation never change a value, so every round trip between layouts
gives identical tensors; casts and quantization are per element (per row for per-channel
scales, whose rows a chunk holds whole), so chunks give the whole tensor's values. FP8 scales
come from the global amax (per tensor: a first pass over the chunks finds it), so all shards of a
weight share them and an FP8 checkpoint reshards bit-exactly too (it is never quantized twice).
"""

from __future__ import annotations

import dataclasses
import math
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.converters.expert_reshard import (
    check_target,
    expert_target_layout,
    piece_coordinates,
    piece_entries,
    split_expert_files,
    stream_expert_bank,
)
from tessera.converters.safetensors_stream import SafetensorsWriter
from tessera.converters.streaming_reader import FP8, Scratch, StreamingReader
from tessera.core.checkpoint import (
    CheckpointError,
    Manifest,
    atomic_directory,
    build_manifest,
    dtype_from_name,
    dtype_name,
    shard_file_name,
    stored_parameters,
    write_manifest,
)
from tessera.core.config import Layout, ModelConfig
from tessera.core.fp8 import quantize, weight_amax
from tessera.core.models.registry import family as model_family
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    global_param_shapes,
    is_expert_param,
    num_parameters,
    shard_columns,
    shard_row_ranges,
    shard_scale,
    shard_spec,
    stage_ids,
    stored_shape,
    stored_shard,
    unshard_scales,
)
from tessera.core.parallel.weight_format import quantizable
from tessera.core.progress import progress_iter
from tessera.core.units import human_bytes, human_count

# Rows of a tensor moved per step (of the widest dtype involved): peak memory is a few of these.
CHUNK_BYTES = 32 << 20


@dataclass
class ConvertSummary:
    """What a conversion did, in numbers (`str()` says it in words)."""

    source: str
    destination: str
    layout: dict[str, int]  # tp, pp, virtual_stages
    placement: str  # looped | v (see core.config.Layout)
    files: int
    tensors: int
    parameters: int
    dtype: str
    fp8: dict[str, str] | None
    bytes_read: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int  # of this process, since it started
    # Mixture-of-Experts: the target's expert grid (ep, etp) and the dp it is folded over.
    expert_grid: tuple[int, int] = (1, 1)
    dp: int = 1

    def __str__(self) -> str:
        lay = self.layout
        fp8 = f", FP8 e4m3 ({self.fp8['granularity']} scales)" if self.fp8 else ""
        files = f"{self.files} weight file{'s' if self.files != 1 else ''}"
        v = ", V placement" if self.placement == "v" else ""
        ep, etp = self.expert_grid
        grid = f", experts ep {ep} x etp {etp} (for dp {self.dp})" if ep * etp > 1 else ""
        return (
            f"wrote {self.destination}: tp {lay['tp']} x pp {lay['pp']} (virtual stages "
            f"{lay['virtual_stages']}{v}){grid}, {files}, {self.dtype}{fp8}\n"
            f"{self.tensors} tensors, {human_count(self.parameters)} parameters; read "
            f"{human_bytes(self.bytes_read)}, wrote {human_bytes(self.bytes_written)} in "
            f"{self.seconds:.1f} s; peak memory (RSS) {human_bytes(self.peak_rss_bytes)}")


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


@dataclass
class _Plan:
    """The target: layout, dtype, FP8, and the `(name -> local shape)` of every file."""

    layout: Layout
    dtype: torch.dtype | None  # None: keep each tensor's dtype
    fp8: dict[str, str] | None  # the output's FP8 description
    quantize: bool  # quantize high-precision linear weights now
    files: dict[tuple[int, int], dict[str, tuple[int, ...]]]
    # Under an expert grid: `{experts-ep{e}-etp{t}-pp{p}.safetensors: {bank: piece shape}}`.
    expert_files: dict[str, dict[str, tuple[int, ...]]] = dataclasses.field(
        default_factory=dict)


def target_files(config: ModelConfig, layout: Layout
                 ) -> dict[tuple[int, int], dict[str, tuple[int, ...]]]:
    """`(tp_rank, pp_rank) -> {global name: local shape}` of every file of `layout`.

    Built from meta-device model chunks, so the names and shapes are those the model's ranks
    hold and `save_checkpoint` stores, except that replicated tensors (norms, row-parallel
    biases, position embeddings) go into every tp rank's file, not only tp rank 0's: then
    each rank reads only its own file. Every tp rank holds the same names; the shapes are the
    stored ones (`sharding.stored_shape`): under kv-head replication a kv head is written once,
    by the first rank of its replica group, and the other ranks of the group read it there.
    Pipeline ranks hold the stages of the layout's placement (`sharding.stage_ids`).
    """
    out: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
    n_stages = layout.num_stages
    for p in range(layout.pp):
        stages = stage_ids(layout, p)
        g = ParallelGroups(tp_rank=0, tp_size=layout.tp, pp_rank=p, pp_size=layout.pp)
        with torch.device("meta"):
            chunks = [model_family(config).stage(config, layout, g, s, n_stages) for s in stages]
        names = list(stored_parameters(chunks))
        out.update({(t, p): {n: stored_shape(n, config, t, layout.tp) for n in names}
                    for t in range(layout.tp)})
    return out


def target_layout(source: Layout, tp: int | None = None, pp: int | None = None,
                  virtual_stages: int | None = None, placement: str | None = None) -> Layout:
    """The layout a conversion writes: unset sizes keep the source's, except that a new
    pipeline size starts from one looped chunk per rank; placement `v` means two chunks per
    rank. Data parallelism and sequence parallelism do not shape files: dp 1, no sp."""
    if placement is None:
        keeps = pp is None and virtual_stages in (None, source.virtual_stages)
        placement = source.placement if keeps else "looped"
    if virtual_stages is None:
        virtual_stages = 2 if placement == "v" else source.virtual_stages if pp is None else 1
    return Layout(tp=source.tp if tp is None else tp, pp=source.pp if pp is None else pp,
                  virtual_stages=virtual_stages, placement=placement)


def _plan(man: Manifest, layout: Layout, dtype: torch.dtype | None, fp8: bool,
          per_channel: bool) -> _Plan:
    layout.validate(man.model)  # ConfigError naming the clash, before anything is written
    if dtype is not None and (dtype == FP8 or not dtype.is_floating_point):
        raise CheckpointError(f"--dtype must be fp32, bf16 or fp16, got {dtype} (FP8: use --fp8)")
    granularity = "channel" if per_channel else "tensor"
    if man.fp8:  # stays FP8 as stored; quantizing twice would lose precision for nothing
        if per_channel and man.fp8.get("granularity") != "channel":
            raise CheckpointError(
                f"the checkpoint is already FP8 with {man.fp8.get('granularity')} scales; "
                "per-channel scales must be made from the original high-precision checkpoint")
        out_fp8, fresh = dict(man.fp8), False
    else:
        out_fp8 = {"format": "e4m3", "granularity": granularity} if fp8 or per_channel else None
        fresh = fp8 or per_channel
    files = target_files(man.model, layout)
    experts = split_expert_files(files, man.model, layout)  # expert grid: banks in pieces
    return _Plan(layout, dtype, out_fp8, fresh, files, experts)


def reshard_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int | None = None,
    pp: int | None = None,
    virtual_stages: int | None = None,
    dtype: torch.dtype | str | None = None,
    fp8: bool = False,
    fp8_per_channel: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    placement: str | None = None,
    ep: int | None = None,
    etp: int | None = None,
    dp: int | None = None,
) -> ConvertSummary:
    """Write the checkpoint `src` to `dst` for the layout `tp` x `pp` (x `virtual_stages`).

    Unset sizes keep the source's (`virtual_stages` becomes 1 when `pp` changes, 2 with
    `placement="v"`, the placement of the ZBV / DualPipeV schedules; see `target_layout`; the
    manifest records the whole target layout). `dtype` casts the
    higher-precision tensors. `fp8` stores the linear-layer weights (`weight_format.quantizable`) as
    float8_e4m3fn with fp32 scales `NAME.scale` next to them in the same files, per tensor or,
    with `fp8_per_channel`, per output channel; an FP8 source stays FP8, bit-exactly.

    Mixture-of-Experts: `ep` x `etp` > 1 writes the expert banks in the expert-grid pieces a
    training run of that layout saves (`converters.expert_reshard`), the layout recording `dp`
    (default: the source's), the source's cp and, with tp > 1, sequence parallelism; unset,
    the banks are written whole (ep 1, etp 1), which every expert layout loads.

    Raises `ConfigError` for a layout the model cannot take, `CheckpointError` for a damaged or
    foreign source, `FileExistsError` if `dst` exists and not `overwrite`; in every case, and
    on any failure mid-way, nothing is left at `dst` (writes go to a temporary directory).
    Tied embeddings are stored once, by the first stage's ranks, as `save_checkpoint` does.
    """
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    reader = StreamingReader(src)
    try:
        man = reader.manifest
        layout = target_layout(man.layout, tp, pp, virtual_stages, placement)
        layout = expert_target_layout(man.layout, layout, ep, etp, dp)
        check_target(layout, man.model, man.layout, dp is not None)
        plan = _plan(man, layout, dtype, fp8, fp8_per_channel)
        if dst.exists() and not overwrite:
            raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
        reader.check()
        with atomic_directory(dst, overwrite=overwrite) as tmp:
            written, weight_map = _write_files(reader, plan, tmp, progress)
            tokenizer = man.tokenizer
            if tokenizer:
                if not (src / tokenizer).is_file():
                    raise CheckpointError(f"{src / tokenizer} is missing (named in the manifest)")
                shutil.copyfile(src / tokenizer, tmp / tokenizer)
            out_dtype = dtype_name(plan.dtype) if plan.dtype else man.dtype
            write_manifest(tmp, build_manifest(man.model, plan.layout, weight_map,
                                               dtype=out_dtype, step=man.step,
                                               tokenizer=tokenizer, fp8=plan.fp8,
                                               extra=man.extra))
    finally:
        reader.close()
    lay = plan.layout
    return ConvertSummary(
        source=str(src), destination=str(dst),
        layout={"tp": lay.tp, "pp": lay.pp, "virtual_stages": lay.virtual_stages},
        placement=lay.placement, files=len(plan.files) + len(plan.expert_files),
        tensors=len(weight_map),
        parameters=num_parameters(man.model),
        dtype=out_dtype, fp8=plan.fp8, bytes_read=reader.bytes_read, bytes_written=written,
        seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes(),
        expert_grid=(lay.ep, lay.etp), dp=lay.dp)


def _out_dtype(reader: StreamingReader, plan: _Plan, name: str) -> torch.dtype:
    stored = reader.stored_dtype(name)
    if stored == FP8 or (plan.quantize and quantizable(name)):
        return FP8
    if plan.dtype is not None and stored.is_floating_point:
        return plan.dtype
    return stored


def _write_files(reader: StreamingReader, plan: _Plan, tmp: Path, progress: bool
                 ) -> tuple[int, dict[str, list[str]]]:
    """Write every target file, tensor by tensor; return bytes written and the weight map."""
    config = reader.manifest.model
    granularity = plan.fp8["granularity"] if plan.fp8 else "tensor"
    dtypes = {name: _out_dtype(reader, plan, name) for name in reader.names()}
    holders: dict[str, list[tuple[int, int]]] = {}  # name -> target files, in tp order
    writers: dict[tuple[int, int], SafetensorsWriter] = {}
    try:
        for (t, p), shapes in sorted(plan.files.items()):
            entries = []
            for name, shape in shapes.items():
                entries.append((name, dtypes[name], shape))
                if dtypes[name] == FP8:
                    rows = (shape[0], 1) if granularity == "channel" else ()
                    entries.append((name + ".scale", torch.float32, rows))
                holders.setdefault(name, []).append((t, p))
            writers[t, p] = SafetensorsWriter(tmp / shard_file_name(t, p), entries,
                                              metadata={"format": "pt"})
        pieces: dict[str, list[str]] = {}  # expert bank -> its piece files (ep-major)
        for file, banks in sorted(plan.expert_files.items()):
            writers[file] = SafetensorsWriter(tmp / file, piece_entries(banks, dtypes),
                                              metadata={"format": "pt"})
            for name in banks:
                pieces.setdefault(name, []).append(file)
        shapes, scratch = global_param_shapes(config), Scratch()
        order = [n for n in shapes if n in holders or n in pieces]  # as save_checkpoint
        for name in progress_iter(order, "reshard", unit="tensor", enabled=progress):
            if is_expert_param(name):  # expert by expert, into whole banks or grid pieces
                grid = (plan.layout.ep, plan.layout.etp) if name in pieces else (1, 1)
                targets = [(writers[f], *piece_coordinates(f)) for f in pieces[name]] if (
                    name in pieces) else [(writers[f], 0, 0) for f in sorted(holders[name])]
                stream_expert_bank(reader, name, dtypes[name], targets, grid, config,
                                   scratch, CHUNK_BYTES)
                continue
            targets = [(t, writers[t, p], plan.files[t, p][name]) for t, p in sorted(holders[name])]
            _stream_tensor(reader, name, shapes[name], dtypes[name], granularity, targets,
                           plan.layout.tp, config, scratch)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.close()
    weight_map = {n: pieces[n] if n in pieces else
                  [shard_file_name(t, p) for t, p in sorted(holders[n])] for n in order}
    return sum(w.size for w in writers.values()), weight_map


def _stream_tensor(reader: StreamingReader, name: str, shape: tuple[int, ...],
                   out_dtype: torch.dtype, granularity: str,
                   targets: list[tuple[int, SafetensorsWriter, tuple[int, ...]]], tp: int,
                   config: ModelConfig, scratch: Scratch) -> None:
    """Write tensor `name` (global `shape`) into every target file holding it, `targets`: (tp
    rank, its file's writer, its local shape), walking the global tensor in row chunks.

    Global rows `[g0, g1)` are gathered from the source shards (each shard's rows and columns
    come from `shard_row_ranges` / `shard_columns`, the layout rules' row-range form), cast or
    quantized as one chunk, and written to the rows (or, for a column split, the columns of the
    same rows) each target holds: one read per source piece and one write per target piece,
    never the whole tensor. Source vocabulary padding is never read; target padding is written
    as zeros. FP8 bytes pass through unchanged with their scales resharded by `shard_scale`;
    fresh per-tensor FP8 scales take a first pass over the chunks for the global amax.
    """
    files = reader.manifest.weight_map[name]
    if shard_spec(name, config).dim is None:
        files = files[:1]  # replicated: any copy is the whole tensor
    src_dtype, rows = reader.stored_dtype(name), shape[0]
    cols = shape[1] if len(shape) == 2 else 1
    tp_src = len(files)

    def layout(tp_rank: int, tp_size: int):  # of the stored form, on both sides
        return (shard_row_ranges(name, config, tp_rank, tp_size, rows, stored=True),
                shard_columns(name, config, tp_rank, tp_size, cols) if len(shape) == 2 else None)

    sources = [(f, *layout(r, tp_src)) for r, f in enumerate(files)]
    quantizing = out_dtype == FP8 and src_dtype != FP8
    per_channel = quantizing and granularity == "channel"
    row_bytes = math.prod(shape[1:]) * max(src_dtype.itemsize, out_dtype.itemsize,
                                           4 if quantizing else 1)
    step = max(1, CHUNK_BYTES // max(1, row_bytes))

    def read(g0: int, g1: int) -> torch.Tensor:
        chunk = scratch.get("chunk", (g1 - g0, *shape[1:]), src_dtype)
        for file, ranges, col in sources:
            for a, b, local in ranges:
                lo, hi = max(a, g0), min(b, g1)
                if lo >= hi:
                    continue
                if col is None:  # the shard holds whole rows: read them into place
                    reader.read_rows(file, name, local + lo - a, chunk[lo - g0:hi - g0])
                else:
                    piece = scratch.get("piece", (hi - lo, col[1] - col[0]), src_dtype)
                    chunk[lo - g0:hi - g0, col[0]:col[1]] = reader.read_rows(
                        file, name, local + lo - a, piece)
        return chunk

    amax = None
    if quantizing and not per_channel:  # per tensor: the global amax first, chunk by chunk
        amax = torch.zeros((), dtype=torch.float32)
        for g0 in range(0, rows, step):
            amax = torch.maximum(amax, weight_amax(read(g0, min(g0 + step, rows))))
    scale_parts = []
    outs = [(t, writer, kept, *layout(t, tp)) for t, writer, kept in targets]
    for g0 in range(0, rows, step):
        g1 = min(g0 + step, rows)
        chunk = read(g0, g1)
        if quantizing:
            chunk, scale = quantize(chunk, per_channel, amax=amax)
            scale_parts.append(scale)
        elif chunk.dtype != out_dtype and out_dtype != FP8:
            chunk = scratch.get("cast", chunk.shape, out_dtype).copy_(chunk)
        for _, writer, kept, ranges, col in outs:
            for a, b, local in ranges:
                lo, hi = max(a, g0), min(b, g1)
                if lo < hi:
                    piece = chunk[lo - g0:hi - g0]
                    if col is not None:  # a column split: this target's columns of the rows
                        piece = scratch.get("cols", (hi - lo, col[1] - col[0]), piece.dtype
                                            ).copy_(piece[:, col[0]:col[1]])
                    _write_piece(writer, name, local + lo - a, kept, piece)
    for _, writer, kept, ranges, _ in outs:  # vocabulary padding: zero rows
        held = sum(b - a for a, b, _ in ranges)
        if held < kept[0]:
            writer.write_rows(name, held, torch.zeros((kept[0] - held, *kept[1:]),
                                                      dtype=out_dtype))
    if out_dtype != FP8:
        return
    if quantizing:
        scale = torch.cat(scale_parts) if per_channel else scale_parts[0]
    else:  # stored FP8: the bytes went through unchanged, and so do the scales
        scale = unshard_scales(name, [reader.read(f, name + ".scale") for f in files], config)
    for t, writer, *_ in outs:
        part = stored_shard(name, shard_scale(name, scale, config, t, tp), config, t, tp)
        writer.write(name + ".scale", part.contiguous())


def _write_piece(writer: SafetensorsWriter, name: str, row: int, kept: tuple[int, ...],
                 piece: torch.Tensor) -> None:
    if row == 0 and tuple(piece.shape) == tuple(kept):
        writer.write(name, piece)  # the whole local tensor in one go
    else:
        writer.write_rows(name, row, piece)
