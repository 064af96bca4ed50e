"""Expert banks in `tessera convert`: any ep x etp in, any ep x etp out, streaming, bit-exact.

A Mixture-of-Experts checkpoint stores each expert bank (`sharding.is_expert_param`, global
shape `(E, R, C)`) whole, in tp rank 0's file (no expert parallelism), or in expert-grid pieces
`experts-ep{e}-etp{t}-pp{p}.safetensors` (`core.expert_checkpoint`). The resharder writes the
target's banks in the same two forms: whole in every tp file of the stage (ep x etp = 1, as the
rest of a converted checkpoint), or in the pieces a training run of the target layout saves,
under the same file names, weight map and manifest layout, and with the same bytes: each piece
file holds its banks in name order, as `safetensors.save_file` lays them out.

Streaming (`stream_expert_bank`): a bank is walked expert by expert, each expert's `(R, C)`
matrix in chunks of rows (`CHUNK_BYTES` of the widest dtype involved, at least one row). The
rows of a chunk are read from whichever source pieces hold them (`sharding.expert_piece`, the
row-range form of `shard_expert_tensor`: a whole bank is the one piece of a 1 x 1 grid), one
plain read of contiguous *flat rows* per piece and row range (the bank viewed as `(E * R, C)`,
`SafetensorsFile.read_flat_rows_into`), and written to the flat rows, or for an etp split of
w2 the columns of those rows, of every target piece holding that expert. So memory is a few
chunk buffers (the rows read, a cast copy, a target's columns), never a bank and never one
expert's matrix unless a chunk is that large: an expert's row wider than `CHUNK_BYTES` is the
only case where a buffer exceeds it (one row).

The target's expert grid is folded over the tp x cp x dp ranks of a stage (`core.config.
Layout`), so a target with ep x etp > 1 records the data-parallel size of the run it is for
(`dp`, default the input's) and the input's cp, and turns on sequence parallelism with tp > 1
(training needs it; it changes no file). `check_target` raises the layout rules' own
messages (`Layout.validate`, `core.expert_config`), plus what to pass to `tessera convert`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tessera.converters.safetensors_stream import SafetensorsWriter
from tessera.converters.streaming_reader import Scratch, StreamingReader
from tessera.core.checkpoint import CheckpointError
from tessera.core.config import ConfigError, Layout, ModelConfig
from tessera.core.expert_checkpoint import expert_file_name, stored_in_pieces
from tessera.core.parallel.sharding import (
    ExpertPiece,
    expert_global_shape,
    expert_local_shape,
    expert_piece,
    is_expert_param,
)

# (writer, ep rank, etp rank) of one target file holding a piece of a bank.
Target = tuple[SafetensorsWriter, int, int]


def expert_target_layout(source: Layout, target: Layout, ep: int | None, etp: int | None,
                         dp: int | None) -> Layout:
    """`target` (from `reshard.target_layout`) with the expert grid `ep` x `etp` (unset: 1,
    whole banks, which every layout loads). With ep x etp > 1 the layout also takes the
    data-parallel size of the run it is for, `dp` (default: the input's), the input's cp, and
    sequence parallelism when tp > 1 (the expert grid folds over tp x cp x dp, and training
    under tp with expert parallelism needs sequence parallelism); otherwise only an explicit
    `dp` changes it."""
    ep, etp = 1 if ep is None else ep, 1 if etp is None else etp
    if ep * etp == 1:
        return target if dp is None else dataclasses.replace(target, dp=dp)
    return dataclasses.replace(target, ep=ep, etp=etp, dp=source.dp if dp is None else dp,
                               cp=source.cp, sequence_parallel=target.tp > 1)


def check_target(layout: Layout, model: ModelConfig, source: Layout, dp_given: bool) -> None:
    """Raise `ConfigError` with every problem of the target `layout` (the layout rules' own
    messages), adding, for an expert grid, which `tessera convert` flags set its numbers."""
    problems = layout.problems(model)
    if not problems:
        return
    if layout.ep * layout.etp > 1:
        where = "--dp" if dp_given else f"the input's dp {source.dp} (set another with --dp)"
        problems.append(
            f"tessera convert: the target is ep {layout.ep} x etp {layout.etp} (--ep / --etp) "
            f"for a run of tp {layout.tp} (--tp) x cp {layout.cp} (the input's) x dp "
            f"{layout.dp} ({where}); pick --ep / --etp / --dp that satisfy the above, or leave "
            "out --ep / --etp for whole banks, which load under any expert layout")
    raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(problems))


def split_expert_files(files: dict[tuple[int, int], dict[str, tuple[int, ...]]],
                       config: ModelConfig, layout: Layout
                       ) -> dict[str, dict[str, tuple[int, ...]]]:
    """Under an expert grid (ep x etp > 1), move the expert banks out of the tp files `files`
    (edited in place) into the piece files of each pipeline rank; return those:
    `{experts-ep{e}-etp{t}-pp{p}.safetensors: {name: piece shape}}`, names in sorted order
    (the order `safetensors.save_file` writes them in). Nothing moves without a grid."""
    if layout.ep * layout.etp == 1:
        return {}
    banks: dict[int, list[str]] = {}
    for (_, p), shapes in files.items():
        names = [n for n in shapes if is_expert_param(n)]
        for n in names:
            del shapes[n]
        banks.setdefault(p, [])
        banks[p] = sorted(set(banks[p]) | set(names))
    return {expert_file_name(e, t, p): {n: expert_local_shape(n, config, layout.ep, layout.etp)
                                        for n in names}
            for p, names in sorted(banks.items()) if names
            for e in range(layout.ep) for t in range(layout.etp)}


def piece_entries(names: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]
                  ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The `SafetensorsWriter` entries of a piece file: its banks in name order."""
    return [(n, dtypes[n], names[n]) for n in sorted(names)]


def piece_coordinates(file: str) -> tuple[int, int]:
    """`(ep rank, etp rank)` of the piece file name `experts-ep{e}-etp{t}-pp{p}.safetensors`."""
    parts = Path(file).stem.split("-")
    return int(parts[1].removeprefix("ep")), int(parts[2].removeprefix("etp"))


def stream_expert_bank(reader: StreamingReader, name: str, out_dtype: torch.dtype,
                       targets: list[Target], grid: tuple[int, int], config: ModelConfig,
                       scratch: Scratch, chunk_bytes: int) -> None:
    """Write expert bank `name` into every target file holding it, walking the global bank
    `(E, R, C)` expert by expert in row chunks (see the module docstring).

    `reader` is the converter's `StreamingReader`, `scratch` its reused buffers; `targets` are
    `(writer, ep rank, etp rank)` of a `grid` = `(ep, etp)` target (`(0, 0)` of `(1, 1)` for
    each tp file holding the whole bank). The source's grid is the manifest's ep x etp when
    the bank is stored in pieces (ep-major, etp-minor), else 1 x 1 (any whole copy).
    """
    files = reader.manifest.weight_map[name]
    lay = reader.manifest.layout
    if stored_in_pieces(name, files):
        src_grid = (lay.ep, lay.etp)
        if len(files) != lay.ep * lay.etp:
            raise CheckpointError(f"{reader.path}: {name} is stored in {len(files)} expert "
                                  f"pieces, but the manifest's ep {lay.ep} x etp {lay.etp} "
                                  f"needs {lay.ep * lay.etp}")
    else:
        src_grid, files = (1, 1), files[:1]
    src_dtype = reader.stored_dtype(name)
    if torch.float8_e4m3fn in (src_dtype, out_dtype):
        raise CheckpointError(f"{name}: expert banks are never stored as FP8 (got {src_dtype} "
                              f"-> {out_dtype})")
    e_all, r_all, c_all = expert_global_shape(name, config)

    def placed(grid_: tuple[int, int], k: int) -> tuple[ExpertPiece, int]:
        """Piece k (ep-major) of a grid and its rows per expert (R_local)."""
        piece = expert_piece(name, config, k // grid_[1], grid_[0], k % grid_[1], grid_[1])
        return piece, sum(b - a for a, b, _ in piece.rows)

    sources = [(f, *placed(src_grid, k)) for k, f in enumerate(files)]
    outs = [(w, *placed(grid, e * grid[1] + t)) for w, e, t in targets]
    row_bytes = c_all * max(src_dtype.itemsize, out_dtype.itemsize)
    step = max(1, chunk_bytes // max(1, row_bytes))
    for expert in range(e_all):
        src_here, out_here = _holding(sources, expert), _holding(outs, expert)
        for g0 in range(0, r_all, step):
            g1 = min(g0 + step, r_all)
            chunk = _read_rows(reader, name, expert, g0, g1, c_all, src_dtype, src_here,
                               scratch)
            if chunk.dtype != out_dtype:
                chunk = scratch.get("cast", chunk.shape, out_dtype).copy_(chunk)
            _write_rows(name, expert, g0, g1, chunk, out_here, scratch)


def _holding(pieces: list, expert: int) -> list:
    """The `(file or writer, piece, rows per expert)` of `pieces` that hold `expert`."""
    return [(x, p, rows) for x, p, rows in pieces if p.experts[0] <= expert < p.experts[1]]


def _overlaps(piece: ExpertPiece, g0: int, g1: int):
    """`(lo, hi, local row)` for each of the piece's row ranges meeting global rows [g0, g1)."""
    for a, b, local in piece.rows:
        lo, hi = max(a, g0), min(b, g1)
        if lo < hi:
            yield lo, hi, local + lo - a


def _read_rows(reader: StreamingReader, name: str, expert: int, g0: int, g1: int, cols: int,
               dtype: torch.dtype, sources: list, scratch: Scratch) -> torch.Tensor:
    """Rows `[g0, g1)` of expert `expert`'s matrix, gathered from the source pieces."""
    chunk = scratch.get("chunk", (g1 - g0, cols), dtype)
    for file, piece, rows_local in sources:
        base = (expert - piece.experts[0]) * rows_local  # the expert's first flat row
        for lo, hi, local in _overlaps(piece, g0, g1):
            if piece.cols is None:  # whole rows: read them into place
                reader.read_flat_rows(file, name, base + local, chunk[lo - g0:hi - g0])
            else:
                c0, c1 = piece.cols
                part = scratch.get("piece", (hi - lo, c1 - c0), dtype)
                chunk[lo - g0:hi - g0, c0:c1] = reader.read_flat_rows(file, name, base + local,
                                                                      part)
    return chunk


def _write_rows(name: str, expert: int, g0: int, g1: int, chunk: torch.Tensor, outs: list,
                scratch: Scratch) -> None:
    """Write rows `[g0, g1)` of expert `expert`'s matrix into every target piece holding it."""
    for writer, piece, rows_local in outs:
        base = (expert - piece.experts[0]) * rows_local
        for lo, hi, local in _overlaps(piece, g0, g1):
            part = chunk[lo - g0:hi - g0]
            if piece.cols is not None:  # an etp split of w2: this piece's columns
                c0, c1 = piece.cols
                part = scratch.get("cols", (hi - lo, c1 - c0), part.dtype).copy_(
                    part[:, c0:c1])
            writer.write_flat_rows(name, base + local, part)

