"""The dynamic-cp scheduler: power-of-two blocks of ranks by sequence length, aligned, each
sequence placed once, and per-rank work balanced (core/parallel/dynamic_cp.py)."""

from __future__ import annotations

import math
import random

import pytest

from tessera.core.parallel.dynamic_cp import Assignment, LayerCost, schedule

# A Llama-like layer (hidden 1024, 8 heads, 4 kv heads, gated MLP 2816).
COST = LayerCost.from_model(1024, 2816, num_heads=8, num_kv_heads=4)


def _log_uniform(n: int, seed: int, low: int = 64, high: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(n)]


def _check_valid(lengths: list[int], cp: int, sched) -> None:
    """Every sequence once, in input order, on an aligned power-of-two block inside the group,
    and the per-rank loads are exactly the split work."""
    assert [a.index for a in sched.assignments] == list(range(len(lengths)))
    assert [a.length for a in sched.assignments] == lengths
    loads = [0.0] * cp
    for a in sched.assignments:
        assert a.ranks & (a.ranks - 1) == 0 and 1 <= a.ranks <= cp
        assert a.first % a.ranks == 0 and a.first + a.ranks <= cp
        assert a.work == COST.work(a.length)
        for r in range(a.first, a.first + a.ranks):
            loads[r] += a.work / a.ranks
    assert sched.loads == pytest.approx(loads)
    assert sum(sched.loads) == pytest.approx(sum(COST.work(n) for n in lengths))


def test_layer_cost_counts_linear_and_causal_attention():
    cost = LayerCost.from_model(64, 128, num_heads=4, num_kv_heads=2, gated_mlp=True)
    # q and o: 64 x 64 each; k and v: 64 x 32 each; gated MLP: 3 x 64 x 128.
    assert cost.linear == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert cost.attention == 128  # 64 for q.k and 64 for the weighted v, per pair
    assert cost.work(3) == 3 * cost.linear + 6 * cost.attention  # 3 + 2 + 1 causal pairs


def test_equal_short_sequences_stay_whole_one_per_rank():
    lengths = [256] * 8
    sched = schedule(lengths, 4, COST)
    _check_valid(lengths, 4, sched)
    assert all(a.ranks == 1 for a in sched.assignments)
    assert sorted(a.first for a in sched.assignments) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sched.imbalance == 1.0


def test_one_long_sequence_spans_the_group_and_short_ones_fill_the_rest():
    lengths = [8192, 512, 512, 512, 512]
    sched = schedule(lengths, 8, COST)
    _check_valid(lengths, 8, sched)
    long, *short = sched.assignments
    # The long one's work is far above the mean per rank: it must be split, over a power of two.
    assert long.ranks >= 4
    assert all(a.ranks == 1 for a in short)
    assert sched.imbalance < fixed_one_rank_imbalance(lengths, 8)


def fixed_one_rank_imbalance(lengths: list[int], cp: int) -> float:
    """The imbalance of keeping every sequence whole (the same greedy, k = 1 for all)."""
    loads = [0.0] * cp
    for n in sorted(lengths, reverse=True):
        loads[loads.index(min(loads))] += COST.work(n)
    return max(loads) / (sum(loads) / cp)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_uniform_lengths_are_balanced(cp, seed):
    """Lengths drawn log-uniformly in 64..8192, 4 per rank: the busiest rank does at most 10%
    more than the mean, while most sequences stay whole."""
    lengths = _log_uniform(4 * cp, seed)
    sched = schedule(lengths, cp, COST)
    _check_valid(lengths, cp, sched)
    assert sched.imbalance <= 1.10, (sched.imbalance, lengths)
    assert sum(a.ranks == 1 for a in sched.assignments) >= len(lengths) // 2
    # Longer sequences never get fewer ranks than shorter ones.
    by_length = sorted(sched.assignments, key=lambda a: a.length)
    assert [a.ranks for a in by_length] == sorted(a.ranks for a in by_length)


def test_cp1_keeps_everything_on_rank_0():
    sched = schedule([100, 5000], 1, COST)
    assert [(a.ranks, a.first) for a in sched.assignments] == [(1, 0), (1, 0)]


def test_padded_length_is_a_multiple_of_twice_the_ranks():
    assert Assignment(0, 1000, 4, 0, 1.0).padded_length == 1000
    assert Assignment(0, 1001, 4, 0, 1.0).padded_length == 1008
    assert Assignment(0, 1001, 1, 0, 1.0).padded_length == 1001


@pytest.mark.parametrize(("lengths", "cp", "message"), [
    ([128], 3, "cp group size 3 is not a power of two"),
    ([128, 0], 2, r"\[\(1, 0\)\]"),
    ([128, 2.5], 2, "positive integers"),
])
def test_bad_input_is_rejected_with_the_numbers(lengths, cp, message):
    with pytest.raises(ValueError, match=message):
        schedule(lengths, cp, COST)


def test_empty_micro_batch():
    sched = schedule([], 4, COST)
    assert sched.assignments == () and sched.loads == (0.0,) * 4 and sched.imbalance == 1.0


# ------------------------------------------------------------------ run-time layout (no ranks)


def _local_batches(cp: int, ids, labels, docs):
    """Every cp rank's `local_batch` (sub-groups are not needed to lay the tokens out)."""
    from tessera.core.parallel.dynamic_cp_runtime import DynamicCP
    from tessera.core.parallel.groups import ParallelGroups

    out = []
    for r in range(cp):
        g = ParallelGroups(cp_rank=r, cp_size=cp, cp_ranks=tuple(range(cp)))
        out.append(DynamicCP(g, COST, "allgather", {}).local_batch(ids, labels, docs))
    return out


def test_local_batches_hold_every_token_once_with_document_positions():
    """Over the cp ranks, the local tokens are the micro-batch's tokens exactly once (plus
    ignored padding), each with its position in its own document, and each rank's row is its
    segments back to back."""
    import torch

    from tessera.core.parallel.context_parallel import document_positions

    T = 64
    ids = torch.arange(2 * T).view(2, T) + 1000  # distinct ids: where each token went
    labels = ids + 5000
    docs = torch.zeros(2, T, dtype=torch.long)
    docs[0, 36:] += 1
    docs[0, 54:] += 1
    docs[0, 59:] += 1  # row 0: documents of 36, 18, 5, 5; row 1: one of 64
    want_pos = dict(zip(ids.flatten().tolist(), document_positions(docs).flatten().tolist()))
    seen: list[int] = []
    ks = set()
    for lb in _local_batches(4, ids, labels, docs):
        ctx = lb.context
        assert lb.ids.shape == lb.labels.shape == ctx.local_positions.shape
        assert list(ctx.starts) == [sum(s.index.numel() for s in ctx.segments[:i])
                                    for i in range(len(ctx.segments))]
        real = lb.labels[0] != -100
        assert torch.equal(lb.labels[0][real], lb.ids[0][real] + 5000)
        assert (lb.ids[0][~real] == 0).all()  # padding: id 0, ignored
        for i, p in zip(lb.ids[0][real].tolist(), ctx.local_positions[0][real].tolist()):
            assert p == want_pos[i]
        seen += lb.ids[0][real].tolist()
        ks |= {s.cp_size for s in ctx.segments}
        for seg, lengths in zip(ctx.segments, ctx.documents):  # whole documents, in order
            assert (lengths is None) == (seg.cp_size > 1)
            if lengths is not None:
                assert sum(lengths) == seg.index.numel()
                assert list(lengths) == torch.unique_consecutive(
                    seg.documents[0], return_counts=True)[1].tolist()
    assert sorted(seen) == ids.flatten().tolist()
    assert ks == {1, 2, 4}


def test_dynamic_cp_configuration_errors_name_the_fix():
    from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
    from tessera.core.parallel.pipeline import validate_training

    model = ModelConfig.from_name("llama-tiny")
    dyn = TrainSchedule(cp_dynamic=True)
    cases = [(Layout(cp=3), "power-of-two blocks of the cp group, but cp is 3"),
             (Layout(cp=1), "cp is 1; use cp 2, 4, 8"),
             (Layout(cp=2, pp=2), "cp_dynamic with pp 2"),
             (Layout(cp=2, tp=2, sequence_parallel=True), "cp_dynamic with sequence_parallel")]
    for layout, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate_training(model, layout, dyn, seq_len=48)
    validate_training(model, Layout(cp=4, tp=2, dp=2), dyn, seq_len=48)  # supported
