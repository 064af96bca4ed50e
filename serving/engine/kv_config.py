"""How the serving KV cache is laid out and sized (`tessera serve --kv-cache ... --kv-cache-memory ...`).

- `kind="paged"` (the default): blocks of `block_size` tokens in one pool
  (`core.paged_kv_cache`), shared through the prefix cache (`prefix_caching`).
- `kind="slots"`: wave 1's cache, one whole-context row per running request (`core.kv_cache`);
  kept for comparison.

`decode_attention` (paged only): how one-token passes attend (`core.paged_attention`):
"gather" copies each row's blocks and masks them (any device); "flex" reads the blocks in place
through FlexAttention with a block mask made from the tables (for CUDA, compiled).

Pool size, in blocks (`resolve_num_blocks`): `num_blocks` if given; else from `memory`, either
a size (`"8GiB"`, `"512MiB"`, or a bare number above 1, read as GiB) or a fraction of the
device's free memory (a bare number in (0, 1]); else as many tokens as `max_batch` slots of the
whole context would hold (the slot cache's memory). One block (the scratch block padding writes
to) is not usable by requests.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from tessera.core.paged_attention import KERNELS
from tessera.core.paged_kv_cache import PagedKVCache

KINDS = ("paged", "slots")
_UNITS = {"": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9, "mib": 1 << 20, "mb": 10 ** 6,
          "kib": 1 << 10, "b": 1}


@dataclass(frozen=True)
class KVCacheConfig:
    kind: str = "paged"
    block_size: int = 16
    memory: str | float | None = None
    num_blocks: int | None = None
    prefix_caching: bool = True
    decode_attention: str = "gather"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kv cache kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.decode_attention not in KERNELS:
            raise ValueError(f"paged decode attention {self.decode_attention!r} is not one of "
                             f"{', '.join(KERNELS)}")
        if self.block_size < 1:
            raise ValueError(f"--kv-block-size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"a paged KV cache needs >= 2 blocks, got {self.num_blocks}")
        if self.memory is not None:
            parse_memory(self.memory)  # fail early on a typo


def parse_memory(memory: str | float) -> tuple[int | None, float | None]:
    """(bytes, None) for a size, (None, fraction) for a fraction of free memory."""
    text = str(memory).strip().lower()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"--kv-cache-memory {memory!r}: give a size (8GiB, 512MiB, or a number "
                         "above 1 in GiB) or a fraction of free memory in (0, 1]")
    value, unit = float(match.group(1)), match.group(2)
    if not unit and 0 < value <= 1:
        return None, value
    if value <= 0:
        raise ValueError(f"--kv-cache-memory must be positive, got {memory!r}")
    return int(value * _UNITS[unit]), None


def free_memory_bytes(device: torch.device | str) -> int:
    """Free memory of `device`: CUDA's free bytes, else the host's available pages."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_num_blocks(config: KVCacheConfig, *, num_layers: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str, max_batch: int,
                       max_seq: int, value_dim: int | None = None) -> int:
    """Blocks in the pool of one rank holding `num_layers` layers of `kv_heads` heads (values
    `value_dim` wide when given, else `head_dim`)."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.memory is None:
        return max_batch * -(-max_seq // config.block_size) + 1
    size, fraction = parse_memory(config.memory)
    if size is None:
        size = int(free_memory_bytes(device) * fraction)
    per_block = PagedKVCache.block_bytes(num_layers, config.block_size, kv_heads, head_dim, dtype,
                                         value_dim)
    blocks = size // per_block
    if blocks < 2:
        raise ValueError(f"--kv-cache-memory {config.memory!r} holds {blocks} blocks of "
                         f"{per_block} bytes; at least 2 are needed")
    return blocks
