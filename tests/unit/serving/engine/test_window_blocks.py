"""The paged KV space of a sliding-window model (`kv_space.PagedSpace` with a window): blocks
wholly before a sequence's window are given back and their table entries become the scratch
block, at most ceil(window / block_size) + 1 are held, nothing is freed twice, a speculative
rollback drops only where `cached` is final, and the scratch block is never published in the
prefix cache."""

from __future__ import annotations

import math

from tessera.serving.engine.block_manager import SCRATCH_BLOCK, BlockHasher, BlockManager
from tessera.serving.engine.kv_space import PagedSpace, SeqState

BLOCK, WINDOW = 4, 6


def _space(prefix_caching: bool = True) -> tuple[PagedSpace, BlockManager]:
    manager = BlockManager(64, BLOCK, prefix_caching)
    return PagedSpace(manager, WINDOW), manager


def _seq(n: int) -> SeqState:
    return SeqState(tokens=list(range(n)), hasher=BlockHasher(BLOCK))


def _step(space: PagedSpace, seq: SeqState, n: int) -> None:
    """One pass of `n` tokens: grow, compute, publish."""
    seq.tokens.extend(range(len(seq.tokens), seq.cached + n))
    assert space.grow(seq, seq.cached + n)
    seq.cached += n
    space.computed(seq)


def test_a_growing_sequence_holds_only_its_window_blocks():
    space, manager = _space()
    seq = _seq(3)
    space.admit(seq)
    bound = math.ceil(WINDOW / BLOCK) + 1
    _step(space, seq, 3)
    for _ in range(40):
        _step(space, seq, 1)
        held = [b for b in seq.blocks if b != SCRATCH_BLOCK]
        assert len(held) <= bound and manager.num_used == len(held)
        # Every position the next query sees is in a held block.
        first_key = seq.cached - WINDOW + 1
        assert all(seq.blocks[i] != SCRATCH_BLOCK
                   for i in range(first_key // BLOCK, len(seq.blocks)))
    assert manager.window_frees == len(seq.blocks) - len(held)
    space.release(seq)
    assert manager.num_used == 0


def test_without_a_window_every_block_is_kept():
    manager = BlockManager(64, BLOCK)
    space, seq = PagedSpace(manager), _seq(0)
    for _ in range(20):
        _step(space, seq, 1)
    assert SCRATCH_BLOCK not in seq.blocks and manager.window_frees == 0


def test_drafts_drop_nothing_until_the_rollback_settles_cached():
    space, manager = _space()
    seq = _seq(0)
    _step(space, seq, 12)
    before = list(seq.blocks)
    # A verify pass of the last token + 4 drafts: `cached` grows, `computed` is not called.
    assert space.grow(seq, seq.cached + 5)
    seq.cached += 5
    assert seq.blocks[:len(before)] == before
    space.rollback(seq, 13)  # one draft accepted
    first_key = 13 - WINDOW + 1
    assert all(b == SCRATCH_BLOCK for b in seq.blocks[:first_key // BLOCK])
    assert all(b != SCRATCH_BLOCK for b in seq.blocks[first_key // BLOCK:])
    space.release(seq)
    assert manager.num_used == 0


def test_blocks_dropped_before_publication_never_publish_the_scratch_block():
    space, manager = _space()
    seq = _seq(0)
    _step(space, seq, 4)  # block 0 of the sequence published
    seq.tokens.extend(range(4, 24))
    assert space.grow(seq, 24)
    seq.cached = 24  # speculative passes: no `computed`
    space.rollback(seq, 24)  # drops blocks 1..3 before they were published
    space.computed(seq)
    published = manager.lookup(seq.hasher.update(seq.tokens))
    assert SCRATCH_BLOCK not in published and len(published) == 1


def test_a_dropped_published_block_is_shared_by_a_later_request():
    space, manager = _space()
    first = _seq(0)
    _step(space, first, 16)  # 4 full blocks published; the first 2 fall out of the window
    dropped = manager.lookup(first.hasher.update(first.tokens))[:2]
    assert all(manager.ref(b) == 0 for b in dropped)
    second = _seq(17)  # the same 16 tokens, then one more
    space.admit(second)
    assert second.cached == 16  # every published block reused, dropped ones included
    space.release(first), space.release(second)
    assert manager.num_used == 0
