"""Who owns which KV block: allocation, prefix-cache sharing by content hash, LRU eviction.

Pure bookkeeping over block ids (no tensors): the blocks themselves live in the model runner's
`core.paged_kv_cache.PagedKVCache`, on every rank, and the engine (rank 0) decides here which
sequence uses which.

- Block 0 is never handed out: it is the scratch block that padding writes to (see
  `PagedKVCache`); `num_usable = num_blocks - 1`.
- A block is *referenced* by every running sequence whose table holds it (`ref`), and *free*
  at ref 0. Free blocks wait in one LRU queue; allocation takes the least recently freed.
- Prefix caching: a full block's content is named by a chained SHA-256 (`BlockHasher`): the
  parent block's digest, then the block's token ids. The chain starts from a root digest of the
  request's namespace (the prompt-tuned task or adapter, and an optional per-tenant
  `cache_salt`), so equal tokens under different tasks or salts never share a block, and a
  block's digest names its whole prefix. SHA-256 rather than Python's `hash`: a tenant must not
  be able to craft a collision that reads another tenant's keys and values.
- A block is registered under its digest once it is full and computed; a freed registered
  block stays findable until the LRU queue hands it out again (eviction). A sequence's blocks
  are freed last-first, so the tail of a prefix (which hashes more tokens and is less likely
  to be shared) is evicted before its head, as vLLM does.
- Counters: `evictions`; `window_frees`, blocks given back because they slid out of a
  sliding-window model's window (`serving.engine.kv_space.PagedSpace`); `peak_used`, the most
  blocks held at once.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

SCRATCH_BLOCK = 0


class BlockHasher:
    """Chained digests of the full blocks of one sequence, computed incrementally."""

    def __init__(self, block_size: int, namespace: Sequence[str | None] = ()):
        self.block_size = block_size
        root = hashlib.sha256(b"tessera-kv-prefix\0")
        for part in namespace:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
            data = b"\xff" if part is None else part.encode("utf-8")
            root.update(struct.pack("<q", len(data)) + data)
        self._root = root.digest()
        self.digests: list[bytes] = []

    def update(self, tokens: Sequence[int]) -> list[bytes]:
        """Digests of every full block of `tokens` (a sequence that only grows)."""
        bs = self.block_size
        for i in range(len(self.digests), len(tokens) // bs):
            parent = self.digests[-1] if self.digests else self._root
            block = tokens[i * bs:(i + 1) * bs]
            self.digests.append(hashlib.sha256(parent + struct.pack(f"<{bs}q", *block)).digest())
        return self.digests

    def truncate(self, n_tokens: int) -> None:
        """Forget the digests of blocks past the first `n_tokens` tokens (tokens rolled back)."""
        del self.digests[n_tokens // self.block_size:]


class BlockManager:
    """`num_blocks` KV blocks of `block_size` tokens (block 0 reserved as scratch)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is scratch), got "
                             f"{num_blocks}: give it more memory or smaller blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        self._digest: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}
        self.evictions = 0
        self.window_frees = 0
        self.peak_used = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold `n_tokens` tokens."""
        return -(-n_tokens // self.block_size)

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `digests` (no side effects)."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        for digest in digests:
            block = self._cached.get(digest)
            if block is None:
                break
            out.append(block)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks` (from `lookup`) for a new sequence."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks (ref 1), evicting the least recently freed cached ones; None (and
        nothing taken) if fewer than `n` are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            digest = self._digest[b]
            if digest is not None:  # evict: its content is about to be overwritten
                del self._cached[digest]
                self._digest[b] = None
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def register(self, block: int, digest: bytes) -> None:
        """Make the full, computed `block` findable under `digest` (a no-op if that content is
        cached already, in another block: this one then stays private and is freed as usual)."""
        if self.prefix_caching and digest not in self._cached and self._digest[block] is None:
            self._cached[digest] = block
            self._digest[block] = digest

    def free(self, blocks: Sequence[int], outside_window: bool = False) -> None:
        """Drop one reference on each of a sequence's `blocks`, last block first;
        `outside_window`: they slid out of a sliding window (counted in `window_frees`)."""
        if outside_window:
            self.window_frees += len(blocks)
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None  # the tail of the LRU queue: evicted last

    def ref(self, block: int) -> int:
        return self._ref[block]
