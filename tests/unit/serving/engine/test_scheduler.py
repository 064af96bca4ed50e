"""The scheduler on its own (no model): token budget, decodes first, first come first served,
priorities, admission without overtaking, and preemption of the newest under block pressure
with recomputation that finds its own blocks in the prefix cache."""

from tessera.serving.engine.block_manager import BlockHasher, BlockManager
from tessera.serving.engine.kv_space import PagedSpace, SeqState, SlotSpace
from tessera.serving.engine.scheduler import Scheduler


def _seq(n: int, priority: int = 0, bs: int | None = None, start: int = 100) -> SeqState:
    return SeqState(tokens=list(range(start, start + n)), priority=priority,
                    hasher=BlockHasher(bs) if bs else None)


def _run(plan) -> None:
    """What the engine does after a pass: the planned tokens are now cached."""
    for seq, n in plan.rows:
        seq.cached += n


def test_budget_decodes_first_then_chunks_then_admission_in_order():
    s = Scheduler(SlotSpace(3), max_running=3, max_step_tokens=8)
    a, b, c, d = _seq(5), _seq(20), _seq(2), _seq(1)
    for seq in (a, b, c, d):
        s.add(seq)
    plan = s.schedule()
    assert plan.rows == [(a, 5), (b, 3)]  # b's first chunk takes the rest of the budget
    assert plan.admitted == [a, b] and s.num_waiting == 2 and (a.slot, b.slot) == (0, 1)
    _run(plan)
    a.tokens.append(1)
    a.n_generated = 1  # a decodes from now on
    for cached in (10, 17):
        plan = s.schedule()
        assert plan.rows == [(a, 1), (b, 7)] and plan.admitted == []  # decode first; no budget
        _run(plan)
        a.tokens.append(1)
        assert b.cached == cached
    plan = s.schedule()
    assert plan.rows == [(a, 1), (b, 3), (c, 2)] and plan.admitted == [c]
    assert c.slot == 2 and not s.space.can_admit() and s.waiting() == [d]  # no slot for d
    s.finish(a)
    assert a.slot == -1 and s.space.can_admit() and a not in s.running


def test_priorities_come_before_arrival_order():
    s = Scheduler(SlotSpace(1), max_running=1, max_step_tokens=64)
    late_urgent, early = _seq(3, priority=-1), _seq(3)
    s.add(early)
    s.add(late_urgent)
    assert s.schedule().admitted == [late_urgent]
    assert s.waiting() == [early]


def test_preemption_frees_the_newest_and_it_resumes_on_its_cached_blocks():
    bs = 4
    manager = BlockManager(1 + 6, bs)  # 6 usable blocks: 24 tokens
    s = Scheduler(PagedSpace(manager), max_running=4, max_step_tokens=64)
    old, new = _seq(11, bs=bs), _seq(9, bs=bs, start=200)
    s.add(old)
    s.add(new)
    plan = s.schedule()
    assert plan.rows == [(old, 11), (new, 9)] and manager.num_free == 0
    _run(plan)
    for seq in (old, new):
        s.space.computed(seq)
        seq.tokens.append(7)
        seq.n_generated = 1
    assert manager.num_cached == 2 + 2
    # old's 12th token fits its third block; new's 10th fits its third block too.
    plan = s.schedule()
    assert plan.rows == [(old, 1), (new, 1)] and not plan.preempted
    _run(plan)
    for seq in (old, new):
        seq.tokens.append(7)
    # old's 13th token needs a 4th block: none free, so the newest (new) is preempted.
    plan = s.schedule()
    assert plan.preempted == [new] and plan.rows == [(old, 1)]
    assert new.cached == 0 and new.blocks == [] and s.waiting() == [new]
    assert s.preemptions == 1 and new.preemptions == 1
    _run(plan)
    s.finish(old)
    # new comes back first in line and finds its two full blocks still cached.
    plan = s.schedule()
    assert plan.admitted == [new] and plan.rows == [(new, 11 - 8)]
    assert s.prefix_hit_tokens == 8 and s.prefix_queried_tokens == 20 + 11


def test_the_first_in_line_that_does_not_fit_stops_admission():
    manager = BlockManager(1 + 3, 4)
    s = Scheduler(PagedSpace(manager), max_running=8, max_step_tokens=64)
    running, big, small = _seq(8), _seq(8), _seq(2)
    s.add(running)
    _run(s.schedule())
    s.add(big)
    s.add(small)
    plan = s.schedule()
    assert plan.admitted == [] and s.waiting() == [big, small] and manager.num_free == 1


def test_rollback_frees_trailing_blocks_and_keeps_what_is_cached():
    """What speculative decoding will need: run several tokens, then keep fewer."""
    manager = BlockManager(1 + 8, 4)
    space = PagedSpace(manager)
    seq = _seq(10, bs=4)
    space.admit(seq)
    assert space.grow(seq, 10)
    seq.cached = 10
    space.computed(seq)
    seq.tokens += [1, 2, 3, 4, 5, 6]  # six draft tokens run in one step
    assert space.grow(seq, 16) and len(seq.blocks) == 4
    seq.cached = 16
    space.computed(seq)
    assert seq.registered == 4
    space.rollback(seq, 11)  # one draft token accepted
    del seq.tokens[11:]
    assert (seq.cached, len(seq.blocks), seq.registered) == (11, 3, 2)
    assert len(seq.hasher.digests) == 2 and manager.num_used == 3
    seq.tokens += [9, 9, 9, 9, 9]  # the next tokens differ from the rejected drafts
    assert space.grow(seq, 16)
    seq.cached = 16
    space.computed(seq)
    assert seq.hasher.digests[2] != BlockHasher(4).update(list(range(100, 110)) +
                                                          [1, 2, 3, 4, 5, 6])[2]
    slots = SlotSpace(1)
    other = _seq(5)
    slots.admit(other)
    other.cached = 5
    slots.rollback(other, 3)
    assert other.cached == 3 and other.slot == 0
