"""A checkpoint's fingerprint: which base a prompt table or a LoRA adapter was tuned on.

sha256 over the model config in its flat form (`core.flat_model_fields.flat_fields`, less its
name and dropout) and, per tensor, its name, shape and about 4,096 evenly spaced values rounded
to bf16. It reads the weights once (as loading them
does), distinguishes any two trainings, and is the same for every layout `tessera convert`
writes and for an fp32 or bf16 copy of the same base (an FP8 copy differs).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from tessera.core.checkpoint import MANIFEST, CheckpointReader
from tessera.core.flat_model_fields import flat_fields

_SAMPLES = 4096


def base_fingerprint(checkpoint: str | os.PathLike) -> str:
    """The fingerprint of a checkpoint's weights (see the module docstring)."""
    path = Path(checkpoint).resolve()
    stat = (path / MANIFEST).stat()
    return _fingerprint(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, mtime_ns: int, size: int) -> str:
    # Keyed by the manifest's mtime and size too: a checkpoint rewritten in place is read again.
    reader = CheckpointReader(path)
    config = flat_fields(reader.manifest.model.to_dict())  # the digest of older releases
    for key in ("name", "dropout"):  # a renamed copy, or another dropout, is the same base
        config.pop(key)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(reader.names()):
        tensor = reader.global_tensor(name)
        flat = tensor.reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES]
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
