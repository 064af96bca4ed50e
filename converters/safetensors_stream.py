"""Read and write safetensors files a tensor, or a range of its rows, at a time: bounded memory.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N,
then N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the tensors' raw little-endian bytes, back to back, offsets counted from the
end of the header. `safetensors.save_file` needs every tensor of a file in memory at once; a
resharded file is known in advance (names, dtypes and shapes come from the layout), so
`SafetensorsWriter` writes the header first and then each tensor, in any order, at its offset.
`SafetensorsFile` reads one tensor with a plain `readinto` (no memory map, so the pages of a
large file never count against the process) and names the problem when a file is damaged.
Both also work on row ranges (`write_rows`, `read_rows_into`): tensors are stored row-major, so
rows `[a, b)` of a tensor are one contiguous byte range and a converter can stream a tensor of
any size through a bounded buffer. A 3-D expert bank `(E, R, C)` is addressed by *flat rows*
(`write_flat_rows`, `read_flat_rows_into`: the tensor viewed as `(E * R, C)`), so a piece
of one expert's matrix streams the same way.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from tessera.core.safetensors_header import HeaderError, read_header

_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class SafetensorsFormatError(ValueError):
    """A file that is not (or no longer) a valid safetensors file."""


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


class SafetensorsWriter:
    """Write a safetensors file whose entries `(name, dtype, shape)` are declared up front.

    Entries are laid out largest element size first, so every tensor starts at an offset
    aligned to its element size. Use as a context manager; `close` fails if an entry was
    never written (a file with holes must not look complete).
    """

    def __init__(self, path: str | os.PathLike,
                 entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        order = sorted(entries, key=lambda e: -e[1].itemsize)  # stable: declared order otherwise
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name, dtype, shape in order:
            if name in self._layout:
                raise ValueError(f"{self.path}: tensor {name!r} declared twice")
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._layout[name] = (dtype, tuple(shape), offset)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned
        self._data_start = 8 + len(raw)
        self.size = self._data_start + offset
        self._pending = set(self._layout)
        self._rows_left: dict[str, int] = {}  # written by rows: bytes not yet written
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._fh.truncate(self.size)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write the declared tensor `name` whole; returns the bytes written."""
        dtype, shape, _ = self._entry(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"declared {dtype} {shape}")
        if name not in self._pending or name in self._rows_left:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        self._pending.discard(name)
        return self._put(name, 0, tensor)

    def write_rows(self, name: str, row: int, tensor: torch.Tensor) -> int:
        """Write rows `[row, row + len(tensor))` of the declared tensor `name` (dim 0 is the
        row: row-major storage makes them one contiguous byte range). Each row once, in any
        order; the tensor is complete when as many rows as it has were written."""
        dtype, shape, _ = self._entry(name)
        n = tensor.shape[0] if tensor.dim() else -1
        if (tensor.dtype != dtype or not shape or tuple(tensor.shape[1:]) != shape[1:]
                or not 0 <= row <= row + n <= shape[0]):
            raise ValueError(f"{self.path}: rows {row}.. of {name!r} as {tensor.dtype} "
                             f"{tuple(tensor.shape)} do not fit the declared {dtype} {shape}")
        return self._put_rows(name, row * _nbytes(dtype, shape[1:]), tensor)

    def write_flat_rows(self, name: str, row: int, tensor: torch.Tensor) -> int:
        """Write the 2-D `tensor` as rows `[row, row + len(tensor))` of the declared tensor
        `name` viewed as 2-D, `(numel / last dim, last dim)`: for an expert bank `(E, R, C)`,
        row `e * R + r` is row r of expert e. Each row once, as with `write_rows`."""
        dtype, shape, _ = self._entry(name)
        width = shape[-1] if shape else 0
        total = math.prod(shape) // width if width else 0
        if (tensor.dtype != dtype or tensor.dim() != 2 or tensor.shape[1] != width
                or not 0 <= row <= row + tensor.shape[0] <= total):
            raise ValueError(f"{self.path}: flat rows {row}.. of {name!r} as {tensor.dtype} "
                             f"{tuple(tensor.shape)} do not fit the declared {dtype} {shape}")
        return self._put_rows(name, row * width * dtype.itemsize, tensor)

    def _put_rows(self, name: str, byte_offset: int, tensor: torch.Tensor) -> int:
        """Write part of `name` at `byte_offset`, counting down the bytes it still lacks."""
        dtype, shape, _ = self._layout[name]
        left = self._rows_left.get(name, _nbytes(dtype, shape)) - _nbytes(dtype, tensor.shape)
        if name not in self._pending or left < 0:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        self._rows_left[name] = left
        if left == 0:
            self._pending.discard(name)
        return self._put(name, byte_offset, tensor)

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        if name not in self._layout:
            raise KeyError(f"{self.path}: tensor {name!r} was not declared")
        return self._layout[name]

    def _put(self, name: str, byte_offset: int, tensor: torch.Tensor) -> int:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._fh.seek(self._data_start + self._layout[name][2] + byte_offset)
        self._fh.write(memoryview(data))
        return data.nbytes

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.close()
        if self._pending:
            raise ValueError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")

    def abort(self) -> None:
        """Close without the completeness check (the caller discards the file)."""
        self._fh.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


class SafetensorsFile:
    """A safetensors file whose header is parsed and checked at once and whose tensors are read
    one at a time, on demand. `get_tensor` and `keys` match `safetensors.safe_open`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fh = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        try:
            self._entries, self.metadata, self._data_start = self._read_header()
        except BaseException:
            self._fh.close()
            raise

    def _read_header(self):
        try:
            header = read_header(self.path)
        except HeaderError as exc:
            raise SafetensorsFormatError(f"{self.path}: {exc}") from exc
        entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.tensors.items():
            if e.dtype not in _DTYPES:
                raise SafetensorsFormatError(f"{self.path}: {name!r} has unknown dtype {e.dtype!r}")
            dtype = _DTYPES[e.dtype]
            if e.end - e.begin != _nbytes(dtype, e.shape):
                raise SafetensorsFormatError(f"{self.path}: {name!r} offsets do not match its shape")
            entries[name] = (dtype, e.shape, e.begin, e.end)
        end = header.data_start + max((e[3] for e in entries.values()), default=0)
        if end > header.file_size:
            raise SafetensorsFormatError(
                f"{self.path}: truncated: the header describes {end} bytes, the file has "
                f"{header.file_size}; re-copy or re-convert it")
        return entries, header.metadata, header.data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """`(dtype, shape)` of tensor `name`, without reading it."""
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype, shape, begin, end = self._entries[name]
        buf = bytearray(end - begin)
        self._fh.seek(self._data_start + begin)
        if self._fh.readinto(buf) != len(buf):
            raise SafetensorsFormatError(f"{self.path}: truncated while reading {name!r}")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

    def read_rows_into(self, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Read rows `[row, row + len(out))` of tensor `name` straight into the contiguous
        tensor `out` (one plain read, no copy); returns `out`."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype, shape, begin, _ = self._entries[name]
        n = out.shape[0] if out.dim() else -1
        if (out.dtype != dtype or not shape or tuple(out.shape[1:]) != shape[1:]
                or not 0 <= row <= row + n <= shape[0] or not out.is_contiguous()):
            raise ValueError(f"{self.path}: cannot read rows {row}.. of {name!r} ({dtype} "
                             f"{shape}) into {out.dtype} {tuple(out.shape)}")
        return self._read_at(name, begin + row * _nbytes(dtype, shape[1:]), out)

    def read_flat_rows_into(self, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Read rows `[row, row + len(out))` of tensor `name` viewed as 2-D, `(numel / last
        dim, last dim)`, into the contiguous 2-D `out` (one plain read): for an expert bank
        `(E, R, C)`, row `e * R + r` is row r of expert e, so any rows of one expert, or whole
        experts, are one contiguous byte range. Returns `out`."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype, shape, begin, _ = self._entries[name]
        width = shape[-1] if shape else 0
        total = math.prod(shape) // width if width else 0
        if (out.dtype != dtype or out.dim() != 2 or out.shape[1] != width
                or not 0 <= row <= row + out.shape[0] <= total or not out.is_contiguous()):
            raise ValueError(f"{self.path}: cannot read flat rows {row}.. of {name!r} ({dtype} "
                             f"{shape}) into {out.dtype} {tuple(out.shape)}")
        return self._read_at(name, begin + row * width * dtype.itemsize, out)

    def _read_at(self, name: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill the contiguous `out` with the bytes at `offset` of the data section (one
        plain read, checked for truncation); returns `out`."""
        size = _nbytes(out.dtype, out.shape)
        if size:
            self._fh.seek(self._data_start + offset)
            if self._fh.readinto(out.view(torch.uint8).reshape(-1).numpy()) != size:
                raise SafetensorsFormatError(f"{self.path}: truncated while reading {name!r}")
        return out

    def close(self) -> None:
        self._fh.close()
