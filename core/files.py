"""How Tessera writes files: atomically, and with the permissions the user's umask gives a plain
`open`. `atomic_file` is the one file writer (a temporary sibling, fsync, one rename);
`core.checkpoint.publish_directory` is its counterpart for whole directories.

`tempfile.mkstemp` and `safetensors.torch.save_file` create files readable by their owner only
(0600). A checkpoint or tokenizer written that way cannot be read by a container running as
another user with the directory mounted, so files made by either are given the mode an
ordinary file would get: 0666 less the umask (0644 under the usual umask 022).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def umask() -> int:
    """The process's umask, read without changing it where the OS allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence second choice)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from `open(path, "w")`: 0666 less the umask."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode a new directory gets from `mkdir`: 0777 less the umask."""
    return 0o777 & ~umask()


@contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path of `target` to write; on success it is fsynced, given
    `file_mode()` and renamed onto `target` in one step, so readers see the old file or the
    whole new one, never a part. On any error the temporary file is removed and `target` is
    untouched. The temporary name is unique per call: ranks writing the same file never share
    one (the last rename wins, and each is complete)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, leaving the file with `file_mode()` instead of 0600."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (manifests record it)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
