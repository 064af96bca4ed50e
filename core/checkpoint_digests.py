"""The sha256 of every file a checkpoint writer puts into a checkpoint, taken as it is written.

Each writer (one per rank) records the files it wrote in its own sidecar,
`digests-rank{r}.json` at the top of the checkpoint directory: `{"algorithm": "sha256",
"files": {RELATIVE_PATH: HEX}}`. The sidecars are written into the temporary directory before
it is published, so they appear together with the files they describe. Each digest is taken
from the very bytes handed to the file system (a tensor file is serialized to memory, hashed,
and those bytes written), never by reading the file back: a damaged write is caught at the next
load instead of being recorded as the truth.

sha256, not blake2b: OpenSSL's sha256 runs on the SHA extensions of current x86 and ARM CPUs
(faster than blake2b there), hashlib releases the GIL while it hashes (a background writer does
not stall the step), and `sha256sum` checks a file by hand.

A checkpoint with no sidecar (written before digests were recorded, or by a tool that does not
record them) has nothing to check; `damaged_files` returns None for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

ALGORITHM = "sha256"
SIDECAR_GLOB = "digests-rank*.json"
_BLOCK = 1 << 24  # bytes per write (and per hash update): large, so the GIL is rarely held


def sidecar_name(rank: int) -> str:
    return f"digests-rank{rank:05d}.json"


class DigestWriter:
    """Writes files into one checkpoint directory, hashing each one's bytes as they go out;
    `finish()` writes this writer's sidecar. Not thread-safe: one writer per thread."""

    def __init__(self, directory: str | os.PathLike, rank: int = 0):
        self.directory, self.rank = Path(directory), rank
        self.digests: dict[str, str] = {}

    def write_bytes(self, relative: str, data: bytes | memoryview) -> None:
        """Write `data` as `directory/relative`, recording its sha256."""
        digest, view = hashlib.new(ALGORITHM), memoryview(data)
        target = self.directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as fh:
            for start in range(0, len(view), _BLOCK):
                block = view[start:start + _BLOCK]
                digest.update(block)
                fh.write(block)
        self.digests[relative] = digest.hexdigest()

    def write_tensors(self, relative: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
        """Write `tensors` as the safetensors file `directory/relative` (as
        `safetensors.torch.save_file` would), recording its sha256."""
        from safetensors.torch import save

        self.write_bytes(relative, save(tensors, metadata=metadata))

    def copy_file(self, relative: str, source: str | os.PathLike) -> None:
        """Copy `source` to `directory/relative`, hashing the bytes as they are copied."""
        digest = hashlib.new(ALGORITHM)
        with open(source, "rb") as src, open(self.directory / relative, "wb") as dst:
            for block in iter(lambda: src.read(_BLOCK), b""):
                digest.update(block)
                dst.write(block)
        self.digests[relative] = digest.hexdigest()
        shutil.copymode(source, self.directory / relative)

    def finish(self) -> Path:
        """Write the sidecar naming every file this writer wrote; returns its path."""
        path = self.directory / sidecar_name(self.rank)
        path.write_text(json.dumps({"algorithm": ALGORITHM, "files": self.digests},
                                   indent=1, sort_keys=True) + "\n")
        return path


def recorded_digests(directory: str | os.PathLike) -> dict[str, str] | None:
    """Every file's recorded digest (from all sidecars), or None when there is no sidecar.
    Raises ValueError naming an unreadable sidecar."""
    sidecars = sorted(Path(directory).glob(SIDECAR_GLOB))
    if not sidecars:
        return None
    out: dict[str, str] = {}
    for sidecar in sidecars:
        try:
            body = json.loads(sidecar.read_text())
            if body["algorithm"] != ALGORITHM:
                raise ValueError(f"algorithm {body['algorithm']!r}, expected {ALGORITHM!r}")
            out.update(body["files"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{sidecar.name} is damaged ({exc})") from exc
    return out


def file_digest(path: str | os.PathLike) -> str:
    digest = hashlib.new(ALGORITHM)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def damaged_files(directory: str | os.PathLike) -> list[tuple[str, str]] | None:
    """`(file, problem)` for each file of checkpoint `directory` whose bytes are not the ones
    written (one full read of every recorded file); an empty list: all match; None: the
    checkpoint records no digests. An unreadable sidecar is reported as damaged itself."""
    directory = Path(directory)
    try:
        digests = recorded_digests(directory)
    except ValueError as exc:
        return [(str(exc).split(" ", 1)[0], str(exc).split(" ", 1)[1])]
    if digests is None:
        return None
    problems = []
    for relative, want in sorted(digests.items()):
        full = directory / relative
        if not full.is_file():
            problems.append((relative, "missing"))
        elif file_digest(full) != want:
            problems.append((relative, f"damaged ({ALGORITHM} mismatch)"))
    return problems
