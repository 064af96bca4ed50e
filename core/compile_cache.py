"""Keep TorchInductor's on-disk caches apart for each CPU vector ISA it generates code for.

Inductor writes C++ kernels whose loops are unrolled for one vector width (16 floats for
AVX-512, 8 for AVX2, scalar for `ATEN_CPU_CAPABILITY=default`) and caches them on disk
(`TORCHINDUCTOR_CACHE_DIR`, shared by every process of the user) under a key that holds the
graph, the torch version and the thread count, but not that width. A process that picks another
ISA then reuses the other one's source and compiles it for its own width: AVX2 code under
`default` does not compile; AVX-512 code under `avx2` compiles and, with half of each 16-wide
block never computed, leaves outputs uninitialised (a NaN loss at the first step).

`use_compile_cache_dir(path)` points Inductor's on-disk caches at a directory of the caller's
(a service keeps it across restarts, so a restart compiles nothing it compiled before).

`key_compile_cache_by_isa()` adds the ISA to the cache key tag that all of torch.compile's
caches include; call it before `torch.compile` runs a graph. It keeps a tag the user set
(`TORCH_COMPILE_CACHE_KEY_TAG`) and adds the ISA once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.compiler.config

_PREFIX = "cpu-vec-isa="


def cpu_vec_isa() -> str:
    """The vector ISA Inductor compiles CPU kernels for in this process, e.g. "avx2"."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())  # "INVALID_VEC_ISA" when it compiles scalar code


def key_compile_cache_by_isa() -> str:
    """Add this process's vector ISA to torch.compile's cache key tag; return the tag."""
    tag = torch.compiler.config.cache_key_tag
    parts = [p for p in tag.split(",") if p and not p.startswith(_PREFIX)]
    tag = ",".join([*parts, _PREFIX + cpu_vec_isa()])
    torch.compiler.config.cache_key_tag = tag
    return tag


def use_compile_cache_dir(path: str | os.PathLike) -> Path:
    """Keep TorchInductor's on-disk caches in `path` (created if missing) for this process and
    the processes it starts; call it before anything compiles. Returns the directory."""
    directory = Path(path).expanduser().resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot use {directory} as the compile cache ({exc.strerror}): give "
                         "a writable directory") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory
