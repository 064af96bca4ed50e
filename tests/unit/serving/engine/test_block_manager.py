"""KV block bookkeeping: chained content hashes, reference counts, LRU eviction (pure Python)."""

import hashlib
import struct

import pytest

from tessera.serving.engine.block_manager import SCRATCH_BLOCK, BlockHasher, BlockManager


def test_chained_sha256_digests_of_full_blocks_only():
    tokens = list(range(10))
    h = BlockHasher(4, ("task", None))
    digests = h.update(tokens)
    assert len(digests) == 2  # the last 2 tokens are not a full block
    # Recomputed by hand: root from the namespace, then parent || int64 tokens.
    root = hashlib.sha256(b"tessera-kv-prefix\0")
    for part in (b"task", b"\xff"):
        root.update(struct.pack("<q", len(part)) + part)
    first = hashlib.sha256(root.digest() + struct.pack("<4q", 0, 1, 2, 3)).digest()
    assert digests[0] == first
    assert digests[1] == hashlib.sha256(first + struct.pack("<4q", 4, 5, 6, 7)).digest()
    incremental = BlockHasher(4, ("task", None))
    for n in (3, 5, 9, 10):  # a growing sequence gives the same digests
        incremental.update(tokens[:n])
    assert incremental.digests == digests
    # Another task, another salt, or another first block changes every digest.
    others = [BlockHasher(4, ("other", None)).update(tokens),
              BlockHasher(4, ("task", "salt")).update(tokens),
              BlockHasher(4, (None, "task")).update(tokens),
              BlockHasher(4, ("task", None)).update([9] + tokens[1:])]
    for other in others:
        assert not set(other) & set(digests)


def test_allocation_references_and_the_scratch_block():
    m = BlockManager(5, 4)
    assert (m.num_usable, m.num_free, m.num_used) == (4, 4, 0)
    a = m.allocate(3)
    assert SCRATCH_BLOCK not in a and len(set(a)) == 3
    assert m.allocate(2) is None and m.num_free == 1  # all or nothing
    b = m.allocate(1)
    m.free(a)
    assert m.num_free == 3 and m.num_used == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        m.free(a)
    m.free(b)
    assert m.blocks_for(0) == 0 and m.blocks_for(4) == 1 and m.blocks_for(5) == 2
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, 4)


def test_prefix_reuse_shares_blocks_and_lru_evicts_tails_first():
    m = BlockManager(7, 2)  # 6 usable
    d = BlockHasher(2).update([1, 2, 3, 4, 5, 6])
    blocks = m.allocate(3)
    for b, digest in zip(blocks, d):
        m.register(b, digest)
    m.register(m.allocate(1)[0], d[0])  # same content elsewhere: stays private
    assert m.lookup(d) == blocks and m.num_cached == 3
    m.share(blocks[:2])  # a second sequence on the first two
    assert m.ref(blocks[0]) == 2 and m.num_free == 2
    m.free(blocks)  # the first sequence ends: its third block is cached and unreferenced
    assert m.lookup(d) == blocks and m.num_free == 3
    m.free(blocks[:2])
    # The free queue, least recently freed first: the 2 never used, the third block, then
    # (freed last block first) the second and the first: the tail of a prefix goes first.
    m.allocate(3)
    assert m.lookup(d) == blocks[:2] and m.evictions == 1
    m.allocate(2)
    assert m.lookup(d) == [] and m.num_free == 0
    off = BlockManager(3, 2, prefix_caching=False)
    b = off.allocate(1)[0]
    off.register(b, d[0])
    assert off.lookup(d) == [] and off.num_cached == 0
