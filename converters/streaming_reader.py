"""The reading side of `converters.reshard`: a checkpoint reader over plain file reads that
counts the bytes it reads, and the reused chunk buffers the converters stream through."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tessera.converters.safetensors_stream import SafetensorsFile, SafetensorsFormatError
from tessera.core.checkpoint import CheckpointError, CheckpointReader
from tessera.core.expert_checkpoint import stored_in_pieces
from tessera.core.parallel.sharding import expert_local_shape, stored_shape

FP8 = torch.float8_e4m3fn


class StreamingReader(CheckpointReader):
    """`CheckpointReader` over plain file reads (no memory map), counting the bytes it reads."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.bytes_read = 0

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._files:
            full = self.path / file
            if not full.is_file():
                raise CheckpointError(f"{full} is missing; the checkpoint is incomplete")
            try:
                self._files[file] = SafetensorsFile(full)
            except (SafetensorsFormatError, OSError) as exc:
                raise CheckpointError(f"{full} is not a readable safetensors file ({exc})") from exc
        return self._files[file]

    def _get(self, file: str, key: str) -> torch.Tensor:
        t = super()._get(file, key)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read_rows(self, file: str, key: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Rows `[row, row + len(out))` of tensor `key` of `file`, read into `out`."""
        return self._read_into(file, key, row, out, flat=False)

    def read_flat_rows(self, file: str, key: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Rows `[row, row + len(out))` of tensor `key` of `file` viewed as 2-D (an expert
        bank `(E, R, C)` as `(E * R, C)`), read into `out`."""
        return self._read_into(file, key, row, out, flat=True)

    def _read_into(self, file: str, key: str, row: int, out: torch.Tensor, *, flat: bool
                   ) -> torch.Tensor:
        handle = self._open(file)
        try:
            (handle.read_flat_rows_into if flat else handle.read_rows_into)(key, row, out)
        except (SafetensorsFormatError, OSError) as exc:
            raise CheckpointError(f"{self.path / file}: cannot read tensor {key!r} ({exc})") from exc
        self.bytes_read += out.numel() * out.element_size()
        return out

    def read(self, file: str, key: str) -> torch.Tensor:
        """Tensor `key` of `file` exactly as stored (an FP8 one still quantized)."""
        return self._get(file, key)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._open(self.manifest.weight_map[name][0]).info(name)[0]

    def check(self) -> None:
        """Open every file and check every tensor's presence and shape, before any work."""
        config = self.manifest.model
        for name, files in self.manifest.weight_map.items():
            for rank, file in enumerate(files):
                # The rank's stored form; replicated: the global shape; an expert-parallel
                # source's expert bank: its expert-grid piece.
                lay = self.manifest.layout
                want = expert_local_shape(name, config, lay.ep, lay.etp) if (
                    stored_in_pieces(name, files)) else stored_shape(
                    name, config, rank, len(files))
                handle = self._open(file)
                if name not in handle.keys():
                    raise CheckpointError(f"{self.path / file} lacks tensor {name!r} (see weight_map)")
                dtype, shape = handle.info(name)
                if shape != want:
                    raise CheckpointError(
                        f"{self.path / file}: {name} has shape {shape}, but {len(files)} shard(s) "
                        f"of the manifest's model need {want}")
                if dtype == FP8 and name + ".scale" not in handle.keys():
                    raise CheckpointError(f"{self.path / file}: FP8 tensor {name} has no scale")

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class Scratch:
    """Named byte buffers reused for every chunk of every tensor: memory stays a few chunks,
    with no fresh pages to fault in, nor freed blocks for the allocator to keep, per chunk."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor of `shape` and `dtype` over buffer `key`."""
        n = math.prod(shape) * dtype.itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=torch.uint8)
        return buf[:n].view(dtype).view(shape)
