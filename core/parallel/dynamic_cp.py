"""Dynamic context parallelism: per micro-batch, how many cp ranks each sequence is spread over.

A fixed cp splits every sequence over the whole cp group, so a short sequence pays the group's
communication for almost no attention work. Here each sequence gets its own power-of-two number
of ranks `k` (1, 2, 4, ... up to the group size) from its length: short sequences stay whole on
one rank, long ones span as many ranks as it takes to keep every rank's work near the mean.

The work of a sequence of L tokens (per layer, in multiply-adds, `LayerCost`) is its per-token
linear work `L * linear` plus causal attention over `L (L + 1) / 2` query-key pairs; split over
`k` ranks with the load-balanced zigzag split (`context_parallel.zigzag_index`), each of the k
ranks does `work / k`. A sequence is split only as far as needed: `k` is the smallest power of
two with `work / k <= total / cp` (the perfectly balanced per-rank load).

Placement: sequences spread over k ranks go to an aligned block of k ranks (`first % k == 0`),
so the sub-groups nest inside the cp group as power-of-two blocks do, and a runtime needs at most
`log2(cp) + 1` group sizes. Sequences are placed largest first (k, then work) on the aligned block
whose busiest rank has the least work so far (longest-processing-time-first greedy). When that
leaves the busiest rank more than `tolerance` above the mean, the biggest piece on that rank is
spread over twice as many ranks (and so is every longer sequence) and everything is placed
again, while that lowers the maximum.

Pure Python, no torch. `dynamic_cp_runtime` lays a micro-batch out by it at run time
(`--cp-dynamic`): the sequences of one block are concatenated and split over its ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """Multiply-adds of one transformer layer: `linear` per token (QKV, output, MLP) and
    `attention` per causal query-key pair (scores plus the weighted sum of values)."""

    linear: float
    attention: float

    @classmethod
    def from_model(cls, hidden_size: int, ffn_hidden_size: int, num_heads: int,
                   num_kv_heads: int | None = None, gated_mlp: bool = True) -> LayerCost:
        """The cost of a Llama-like (gated MLP) or GPT-like layer of these sizes."""
        kv = hidden_size * (num_kv_heads or num_heads) // num_heads
        qkvo = hidden_size * (2 * hidden_size + 2 * kv)
        mlp = (3 if gated_mlp else 2) * hidden_size * ffn_hidden_size
        return cls(linear=float(qkvo + mlp), attention=2.0 * hidden_size)

    def work(self, length: int) -> float:
        """The work of one whole sequence of `length` tokens."""
        return length * self.linear + length * (length + 1) / 2 * self.attention


@dataclass(frozen=True)
class Assignment:
    """Where one sequence goes: ranks `first .. first + ranks - 1` of the cp group."""

    index: int  # position in the input lengths
    length: int
    ranks: int  # a power of two
    first: int  # a multiple of `ranks`
    work: float  # the whole sequence's, split evenly over its ranks

    @property
    def padded_length(self) -> int:
        """The length padded to a multiple of `2 * ranks`, as the zigzag split needs."""
        step = 2 * self.ranks if self.ranks > 1 else 1
        return -(-self.length // step) * step


@dataclass(frozen=True)
class Schedule:
    """A micro-batch's assignments (in input order) and the work each cp rank ends up with."""

    assignments: tuple[Assignment, ...]
    loads: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """The busiest rank's work over the mean (1.0 is perfect balance)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def _check(lengths: Sequence[int], cp_size: int) -> None:
    if cp_size < 1 or cp_size & (cp_size - 1):
        raise ValueError(f"cp group size {cp_size} is not a power of two; dynamic cp spreads "
                         "sequences over power-of-two blocks of ranks: use 1, 2, 4, 8, ...")
    bad = [(i, n) for i, n in enumerate(lengths) if not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"sequence lengths must be positive integers; got {bad[:5]} "
                         "(index, length): drop empty sequences before scheduling")


def ranks_for(length: int, cost: LayerCost, target: float, cp_size: int) -> int:
    """The smallest power of two k <= `cp_size` with `cost.work(length) / k <= target`."""
    k, work = 1, cost.work(length)
    while k < cp_size and work / k > target:
        k *= 2
    return k


def schedule(lengths: Sequence[int], cp_size: int, cost: LayerCost,
             tolerance: float = 1.05) -> Schedule:
    """Spread the sequences of one micro-batch over a cp group of `cp_size` ranks (see the
    module docstring), splitting further while the busiest rank does more than `tolerance`
    times the mean and a split helps. Raises ValueError for a cp size that is not a power of
    two or a length that is not a positive integer."""
    _check(lengths, cp_size)
    if not lengths:
        return Schedule((), (0.0,) * cp_size)
    target = sum(cost.work(n) for n in lengths) / cp_size
    ks = [ranks_for(n, cost, target, cp_size) for n in lengths]
    best = _place(lengths, ks, cp_size, cost)
    # Greedy placement of whole sequences can leave a rank with two near-target sequences:
    # spread the biggest piece on the busiest rank over twice the ranks while that helps.
    while best.imbalance > tolerance:
        busiest = best.loads.index(max(best.loads))
        pieces = [a for a in best.assignments
                  if a.first <= busiest < a.first + a.ranks and a.ranks < cp_size]
        if not pieces:
            break
        piece = max(pieces, key=lambda a: (a.work / a.ranks, -a.index))
        # Longer sequences keep at least as many ranks as shorter ones (the order of
        # `ranks_for`): they are spread over the new size too.
        new_k = ks[piece.index] * 2
        trial_ks = [max(k, new_k) if n > piece.length or j == piece.index else k
                    for j, (k, n) in enumerate(zip(ks, lengths))]
        trial = _place(lengths, trial_ks, cp_size, cost)
        if trial.imbalance >= best.imbalance:
            break
        ks, best = trial_ks, trial
    return best


def _place(lengths: Sequence[int], ks: list[int], cp_size: int, cost: LayerCost) -> Schedule:
    """Place sequence i on an aligned block of ks[i] ranks, largest first (k, then work), on the
    block whose busiest rank has the least work so far (ties: the lowest ranks)."""
    loads = [0.0] * cp_size
    placed: dict[int, Assignment] = {}
    order = sorted(range(len(lengths)), key=lambda i: (-ks[i], -cost.work(lengths[i]), i))
    for i in order:
        k, work = ks[i], cost.work(lengths[i])
        first = min(range(0, cp_size, k), key=lambda f: (max(loads[f:f + k]), f))
        for r in range(first, first + k):
            loads[r] += work / k
        placed[i] = Assignment(i, lengths[i], k, first, work)
    return Schedule(tuple(placed[i] for i in range(len(lengths))), tuple(loads))
