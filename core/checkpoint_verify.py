"""Check a checkpoint's weight files against its manifest without reading a tensor.

`verify_checkpoint(path)` reads each safetensors header (8-byte length, JSON) and returns one
`FileProblem` per damage it finds: a file the manifest names that is missing; a header that is
cut or not JSON; a tensor whose bytes end past the file's end (a truncated copy) or whose byte
range does not fit its dtype and shape; a tensor the manifest puts in the file that is not
there, or one there that the manifest does not know; a dtype the checkpoint cannot hold; shards
that do not add up to the parameter's global shape. An empty list: the files match.

Each per-file test is a `FileCheck` (file path, parsed header, the manifest's expectations for
that file -> problems), so a further test, such as a content hash recorded in the manifest, is
one more function in `checks`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tessera.core.checkpoint import Manifest, read_manifest
from tessera.core.expert_checkpoint import stored_in_pieces
from tessera.core.parallel.sharding import global_param_shapes, padded_vocab_size, shard_spec
from tessera.core.safetensors_header import ITEM_BYTES, Header, HeaderError, read_header

_MANIFEST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class FileProblem:
    """One damage found in `file` (relative to the checkpoint directory)."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclass
class Expected:
    """What the manifest says one file holds."""

    names: set[str] = field(default_factory=set)
    fp8: bool = False  # FP8 weights may be stored as F8_E4M3 with an F32 `NAME.scale`
    dtype: str = "F32"  # the manifest's dtype, as a safetensors code


FileCheck = Callable[[Path, Header, Expected], list[str]]


def check_tensors(file: Path, header: Header, expected: Expected) -> list[str]:
    """Names, dtypes and byte ranges of `file`'s tensors against the manifest and file size."""
    problems = []
    data_size = header.file_size - header.data_start
    for name in sorted(expected.names - set(header.tensors)):
        problems.append(f"tensor {name!r} is missing (the manifest puts it in this file)")
    allowed = expected.names | ({n + ".scale" for n in expected.names} if expected.fp8 else set())
    for name in sorted(set(header.tensors) - allowed):
        problems.append(f"holds tensor {name!r}, which the manifest does not list for this file")
    for name, t in sorted(header.tensors.items()):
        dtypes = {expected.dtype} | ({"F8_E4M3", "F32"} if expected.fp8 else set())
        if t.dtype not in dtypes:
            problems.append(f"tensor {name!r} is {t.dtype}, expected {' or '.join(sorted(dtypes))}")
            continue
        want = math.prod(t.shape) * ITEM_BYTES[t.dtype]
        if t.end > data_size:
            problems.append(f"tensor {name!r} ends at byte {header.data_start + t.end} but the "
                            f"file has {header.file_size} bytes: truncated")
        elif t.end - t.begin != want or t.begin < 0:
            problems.append(f"tensor {name!r} spans bytes [{t.begin}, {t.end}) of the data, "
                            f"but {t.dtype} {list(t.shape)} needs {want}: corrupted header")
    end = max((t.end for t in header.tensors.values()), default=0)
    if end < data_size and not problems:
        problems.append(f"{data_size - end} bytes after the last tensor: not the file written")
    return problems


DEFAULT_CHECKS: tuple[FileCheck, ...] = (check_tensors,)


def verify_checkpoint(path: str | os.PathLike, manifest: Manifest | None = None,
                      checks: Sequence[FileCheck] = DEFAULT_CHECKS) -> list[FileProblem]:
    """Every damage found in checkpoint `path`'s weight files (empty: they match `manifest`,
    read from `path` when not given). Raises `CheckpointError` for an unreadable manifest."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    expected: dict[str, Expected] = {}
    dtype = _MANIFEST_DTYPES.get(manifest.dtype, manifest.dtype)
    for name, files in manifest.weight_map.items():
        for f in files:
            expected.setdefault(f, Expected(fp8=bool(manifest.fp8), dtype=dtype)).names.add(name)
    problems: list[FileProblem] = []
    headers: dict[str, Header] = {}
    for f, want in sorted(expected.items()):
        full = path / f
        if not full.is_file():
            problems.append(FileProblem(f, "missing (the manifest lists "
                                           f"{len(want.names)} tensors in it)"))
            continue
        try:
            headers[f] = read_header(full)
        except HeaderError as exc:
            problems.append(FileProblem(f, str(exc)))
            continue
        problems += [FileProblem(f, p) for check in checks for p in check(full, headers[f], want)]
    if not problems:
        problems += _shape_problems(manifest, headers)
    return problems


def _shape_problems(manifest: Manifest, headers: dict[str, Header]) -> list[FileProblem]:
    """Each parameter's stored shards against its global shape."""
    config, out = manifest.model, []
    for name, shape in global_param_shapes(config).items():
        files = manifest.weight_map.get(name, [])
        shards = [headers[f].tensors[name].shape for f in files]
        spec = shard_spec(name, config)
        if stored_in_pieces(name, files):  # expert grid pieces: each element stored once
            ok = sum(math.prod(s) for s in shards) == math.prod(shape)
        elif spec.dim is None or len(files) == 1:
            ok = all(s == tuple(shape) for s in shards)
        else:
            rows = padded_vocab_size(shape[spec.dim], len(files)) if spec.vocab else shape[spec.dim]
            others = [s[:spec.dim] + s[spec.dim + 1:] for s in shards]
            want = tuple(shape[:spec.dim]) + tuple(shape[spec.dim + 1:])
            ok = all(o == want for o in others) and sum(s[spec.dim] for s in shards) == rows
        if not ok:
            out.append(FileProblem(", ".join(files), f"tensor {name!r} is stored as "
                                   f"{[list(s) for s in shards]}, which does not make its "
                                   f"global shape {list(shape)}"))
    return out
