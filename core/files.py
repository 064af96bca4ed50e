"""File permissions of what Tessera writes: what the user's umask gives a plain `open`.

`tempfile.mkstemp` and `safetensors.torch.save_file` create files readable by their owner only
(0600). A checkpoint or tokenizer written that way cannot be read by a container running as
another user with the directory mounted, so files made by either are given the mode an
ordinary file would get: 0666 less the umask (0644 under the usual umask 022).
"""

from __future__ import annotations

import os
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


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, leaving the file with `file_mode()` instead of 0600."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


def make_readable(path: str | os.PathLike, fd: int | None = None) -> None:
    """Give a file made by `mkstemp` (0600) the mode of an ordinary new file."""
    if fd is not None:
        os.fchmod(fd, file_mode())
    else:
        os.chmod(path, file_mode())
