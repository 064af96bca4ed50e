"""The KV cache as the scheduler sees it: room for a sequence's tokens, and how a pass names it.

Two kinds, one interface (`KVSpace`), so one scheduler serves both:
- `SlotSpace`: wave 1's cache (`core.kv_cache.KVCache`). A sequence takes one slot, a row
  that holds the whole context, when admitted; growing never fails; a pass names rows by slot.
- `PagedSpace`: the paged cache (`core.paged_kv_cache.PagedKVCache`). A sequence holds a list
  of blocks (`SeqState.blocks`), taken as it grows (`serving.engine.block_manager`); growing fails
  when no block is free (the scheduler then preempts); a pass names rows by block tables.
  With prefix caching, admission starts a sequence on the cached blocks of its prefix, and
  blocks are registered for others as soon as they are full and computed.

Sliding-window models (`ModelConfig.sliding_window`): a block wholly before the window of the
next token a sequence computes is given back as soon as the sequence has computed past it, and
its table entry becomes the scratch block (which the window masks out), so a sequence holds at
most ceil(window / block_size) + 1 blocks however long it grows. A freed block that was
registered stays findable in the prefix cache until evicted: its keys and values still match
its digest, so another request may share it.

`rollback` cuts a sequence back to fewer cached tokens (freeing trailing blocks): speculative
decoding (`serving.engine.speculative`) drops rejected draft tokens with it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tessera.core.kv_cache import KVCache
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.serving.engine.block_manager import SCRATCH_BLOCK, BlockHasher, BlockManager
from tessera.serving.engine.kv_config import KVCacheConfig


@dataclass(eq=False, kw_only=True)
class SeqState:
    """What the scheduler and the KV space keep per request (the engine's sequence extends it).

    `tokens` only grows (prompt, then sampled tokens); `cached` of them have keys and values in
    the cache. Preemption sets `cached` back to 0 and the sequence is recomputed from its tokens
    (a step may thus run several tokens of a sequence and a later one roll `cached` back).
    """

    tokens: list[int]
    priority: int = 0  # lower runs first; ties: first come, first served
    order: int = 0  # arrival number, set by the scheduler
    cached: int = 0
    n_generated: int = 0
    slot: int = -1  # SlotSpace
    blocks: list[int] = field(default_factory=list)  # PagedSpace: the block table
    hasher: BlockHasher | None = None  # PagedSpace with prefix caching
    reuse_prefix: bool = True  # look cached blocks up at admission (else only register)
    registered: int = 0  # leading blocks registered in the prefix cache
    preemptions: int = 0
    rope_recomputed: bool = False  # re-encoded once at `Scheduler.recompute_at`
    # Speculative decoding (serving.engine.speculative): draft tokens to run after `tokens` this step,
    # not yet verified (never part of `tokens`, so never hashed into the prefix cache).
    draft: list[int] = field(default_factory=list)


class KVSpace(Protocol):
    def can_admit(self) -> bool:
        """Whether a new sequence could start (a free slot; always, for blocks)."""
        ...

    def admit(self, seq: SeqState) -> None:
        """Start `seq` (cached 0): take its slot, or its prefix's cached blocks (`cached`)."""
        ...

    def grow(self, seq: SeqState, n_tokens: int) -> bool:
        """Make room for `n_tokens` tokens of `seq`; False (nothing taken) if there is none."""
        ...

    def computed(self, seq: SeqState) -> None:
        """After a pass raised `seq.cached`: publish what is now shareable."""
        ...

    def release(self, seq: SeqState) -> None:
        """Give back everything `seq` holds (it finished or was preempted)."""
        ...

    def rollback(self, seq: SeqState, n_tokens: int) -> None:
        """Keep only the first `n_tokens` of `seq`'s tokens in the cache (e.g. rejected
        speculative tokens): `cached` drops to at most `n_tokens`, later blocks are freed.
        The caller truncates `seq.tokens` to match before it grows again."""
        ...

    def rows(self, seqs: list[SeqState], length: int) -> torch.Tensor:
        """Where a pass reading up to `length` tokens finds each row: slots `(B,)` or block
        tables `(B, W)`."""
        ...


class SlotSpace:
    """One whole-context slot per sequence, lowest free slot first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap

    def can_admit(self) -> bool:
        return bool(self._free)

    def admit(self, seq: SeqState) -> None:
        seq.slot = heapq.heappop(self._free)

    def grow(self, seq: SeqState, n_tokens: int) -> bool:
        return True

    def computed(self, seq: SeqState) -> None:
        pass

    def release(self, seq: SeqState) -> None:
        if seq.slot >= 0:
            heapq.heappush(self._free, seq.slot)
            seq.slot = -1

    def rollback(self, seq: SeqState, n_tokens: int) -> None:
        seq.cached = min(seq.cached, n_tokens)  # later positions are rewritten before use

    def rows(self, seqs: list[SeqState], length: int) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs])


class PagedSpace:
    """Blocks from a `BlockManager`, shared through the prefix cache.

    `window`: the model's widest sliding window when every layer has one (None: some layer
    attends to the whole context, so every block is kept). Blocks are dropped only where
    `cached` is final (`computed`, `rollback`), never after a speculative pass that a rollback
    may still cut back.
    """

    def __init__(self, manager: BlockManager, window: int | None = None):
        self.manager = manager
        self.block_size = manager.block_size
        self.window = window

    def _held(self, blocks: list[int]) -> list[int]:
        """The blocks of a table that a sequence holds (not the scratch of dropped ones)."""
        return [b for b in blocks if b != SCRATCH_BLOCK]

    def _drop_outside_window(self, seq: SeqState) -> None:
        """Free the leading blocks no later query of `seq` can see (positions before
        `seq.cached - window + 1`, the first key of its next token's window)."""
        if self.window is None:
            return
        first_key = seq.cached - self.window + 1
        dropped = []
        for i in range(min(max(first_key, 0) // self.block_size, len(seq.blocks))):
            if seq.blocks[i] != SCRATCH_BLOCK:
                dropped.append(seq.blocks[i])
                seq.blocks[i] = SCRATCH_BLOCK
        if dropped:
            self.manager.free(dropped, outside_window=True)

    def can_admit(self) -> bool:
        return True

    def admit(self, seq: SeqState) -> None:
        if seq.hasher is None or not seq.reuse_prefix:
            return
        digests = seq.hasher.update(seq.tokens)
        # The last token is always computed (its logits are needed), in a block of its own:
        # a shared block is never written again.
        usable = (len(seq.tokens) - 1) // self.block_size
        hits = self.manager.lookup(digests[:usable])
        self.manager.share(hits)
        seq.blocks, seq.registered = list(hits), len(hits)
        seq.cached = len(hits) * self.block_size
        self._drop_outside_window(seq)

    def grow(self, seq: SeqState, n_tokens: int) -> bool:
        need = self.manager.blocks_for(n_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        new = self.manager.allocate(need)
        if new is None:
            return False
        seq.blocks.extend(new)
        return True

    def _register_full(self, seq: SeqState) -> None:
        full = seq.cached // self.block_size
        if seq.hasher is None or full <= seq.registered:
            return
        digests = seq.hasher.update(seq.tokens)
        for i in range(seq.registered, full):
            if seq.blocks[i] != SCRATCH_BLOCK:  # dropped from a window before it was published
                self.manager.register(seq.blocks[i], digests[i])
        seq.registered = full

    def computed(self, seq: SeqState) -> None:
        self._register_full(seq)
        self._drop_outside_window(seq)

    def release(self, seq: SeqState) -> None:
        self.manager.free(self._held(seq.blocks))
        seq.blocks, seq.registered = [], 0

    def rollback(self, seq: SeqState, n_tokens: int) -> None:
        # A registered block past the cut stays cached: its content still matches its digest.
        keep = self.manager.blocks_for(n_tokens)
        self.manager.free(self._held(seq.blocks[keep:]))
        del seq.blocks[keep:]
        seq.cached = min(seq.cached, n_tokens)
        seq.registered = min(seq.registered, n_tokens // self.block_size)
        if seq.hasher is not None:
            seq.hasher.truncate(n_tokens)
        self._drop_outside_window(seq)

    def rows(self, seqs: list[SeqState], length: int) -> torch.Tensor:
        width = self.manager.blocks_for(length)
        tables = torch.full((len(seqs), width), SCRATCH_BLOCK, dtype=torch.long)
        for r, seq in enumerate(seqs):
            held = seq.blocks[:width]
            tables[r, :len(held)] = torch.tensor(held, dtype=torch.long)
        return tables


def kv_space_for(cache: KVCache | PagedKVCache, kv: KVCacheConfig | None, max_batch: int
                 ) -> tuple[KVSpace, BlockManager | None, int | None]:
    """The scheduler's view of a runner's cache: the space, the paged cache's bookkeeping (None
    for slots) and the tokens the whole pool holds (None for slots). Prefix caching follows
    `kv.prefix_caching` (on without a config). A paged cache whose every layer has a sliding
    window (`PagedKVCache.windows`) frees blocks outside it (`PagedSpace`)."""
    if not isinstance(cache, PagedKVCache):
        return SlotSpace(max_batch), None, None
    blocks = BlockManager(cache.num_blocks, cache.block_size,
                          kv.prefix_caching if kv is not None else True)
    window = None if None in cache.windows else max(cache.windows)
    return (PagedSpace(blocks, window), blocks,
            blocks.num_usable * cache.block_size)
