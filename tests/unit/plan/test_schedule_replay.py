"""The planner's pipeline arithmetic against a step-by-step replay of the schedule PTD-P ran.

The replay follows `forward_backward_pipelining_with_interleaving` of Megatron-LM as of the
paper's Table 1 runs (`megatron/schedules.py` and `p2p_communication.py`, 2021): each rank
runs its warm-up forwards ((p - rank - 1) x 2 + (v - 1) x p of them), then forward/backward
pairs, then the cool-down backwards, and after every chunk one batched send/receive with its
neighbours that blocks until the matching peers have posted theirs (`req.wait()` then
`torch.cuda.synchronize()`). Times are abstract: a chunk's forward and backward, and one
tensor's transfer (a rank's sends of one exchange go out one after the other on its NIC).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tessera.plan import formulas as F


def _programs(p: int, v: int, m: int) -> list[list[tuple]]:
    """Each rank's ops in order: ("F" | "B", chunk) and ("C", [(send|recv, peer), ...])."""
    out = []
    n = m * v
    for rank in range(p):
        prog: list[tuple] = []

        def chunk(k: int, forward: bool) -> int:
            c = (k % (p * v)) // p
            return c if forward else v - 1 - c

        def exchange(send_next: bool, send_prev: bool, recv_prev: bool, recv_next: bool,
                     prog: list[tuple] = prog, rank: int = rank) -> None:
            ops = [(kind, peer) for kind, peer, on in (
                ("send", (rank - 1) % p, send_prev), ("recv", (rank - 1) % p, recv_prev),
                ("send", (rank + 1) % p, send_next), ("recv", (rank + 1) % p, recv_next))
                if on]
            prog.append(("C", ops))

        first_rank, last_rank = rank == 0, rank == p - 1
        all_warmup = m == p
        warmup = n if all_warmup else min((p - rank - 1) * 2 + (v - 1) * p, n)
        if not first_rank:
            exchange(False, False, True, False)
        for k in range(warmup):
            prog.append(("F", chunk(k, True)))
            recv_prev = not (first_rank and chunk(k + 1, True) == 0) and k != n - 1
            send = not (last_rank and chunk(k, True) == v - 1)
            recv_next = k == warmup - 1 and not all_warmup and not last_rank
            exchange(send, False, recv_prev, recv_next)
        steady = n - warmup
        for k in range(steady):
            fk = k + warmup
            prog += [("F", chunk(fk, True)), ("B", chunk(k, False))]
            send_f = not (last_rank and chunk(fk, True) == v - 1)
            send_b = not (first_rank and chunk(k, False) == 0)
            recv_prev = not (first_rank and chunk(fk - (p - 1), True) == v - 1)
            recv_next = not (last_rank and chunk(k - (p - 1), False) == 0)
            exchange(send_f, send_b, recv_prev and k != steady - 1, recv_next)
        if all_warmup and not last_rank:
            exchange(False, False, False, True)
        for k in range(steady, n):
            prog.append(("B", chunk(k, False)))
            recv_next = not (last_rank and chunk(k + 1, False) == v - 1) and k != n - 1
            exchange(False, not (first_rank and chunk(k, False) == 0), False, recv_next)
        out.append(prog)
    return out


def replay(p: int, v: int, m: int, forward: float, backward: float, transfer: float,
           heavy: float = 0.0) -> float:
    """Time of one step. `heavy`: extra forward + backward work of the last rank's last
    chunk (the output layer and loss), split 1:2 like the rest."""
    progs = _programs(p, v, m)
    senders: dict[tuple[int, int], list] = defaultdict(list)
    receivers: dict[tuple[int, int], list] = defaultdict(list)
    for r, prog in enumerate(progs):
        for i, op in enumerate(prog):
            if op[0] == "C":
                for kind, peer in op[1]:
                    if kind == "send":
                        senders[(r, peer)].append((r, i))
                    else:
                        receivers[(peer, r)].append((r, i))
    peers: dict[tuple[int, int], list] = defaultdict(list)
    for link, sends in senders.items():
        assert len(sends) == len(receivers[link]), link  # every send is received
        for a, b in zip(sends, receivers[link]):
            peers[a].append(b)
            peers[b].append(a)
    posted: dict[tuple[int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r, prog in enumerate(progs):
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if op[0] != "C":
                    extra = heavy if (r == p - 1 and op[1] == v - 1) else 0.0
                    clock[r] += (forward + extra / 3 if op[0] == "F"
                                 else backward + 2 * extra / 3)
                    pos[r] += 1
                    continue
                posted[(r, pos[r])] = clock[r]
                mine = peers[(r, pos[r])]
                if not all(q in posted for q in mine):
                    break  # blocked until the peers reach their matching exchange
                sends = sum(kind == "send" for kind, _ in op[1])
                clock[r] = max([clock[r]] + [posted[q] for q in mine]) + sends * transfer
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(prog) for r, prog in enumerate(progs)), "deadlock"
    return max(clock)


SHAPES = [(4, 5, 16), (8, 2, 16), (4, 3, 4), (16, 2, 32)]  # (p, v, m), m a multiple of p


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_bubble_is_ptdp_interleaved_fraction(p, v, m):
    ideal = m * v * (1.0 + 2.0)
    assert replay(p, v, m, 1.0, 2.0, 0.0) == pytest.approx(
        ideal * (1 + F.bubble_fraction(p, m, v)))


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_heavier_last_stage_costs_each_micro_batch_not_the_bubble(p, v, m):
    # estimate.step_time: the output layer adds to every micro-batch slot of the last rank;
    # the bubble is the other ranks' (p - 1)/v micro-batch times.
    base = replay(p, v, m, 1.0, 2.0, 0.0)
    assert replay(p, v, m, 1.0, 2.0, 0.0, heavy=0.75) - base == pytest.approx(m * 0.75)


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_transfers_on_the_critical_path(p, v, m):
    # Each exchange blocks; the marginal cost of a transfer counts those on the critical
    # path: the steady state's 2 v m and some of the fill and drain (1, 9, 25 for p = 4, 8,
    # 16; 2 v m + 2 with m = p). formulas.pipeline_critical_transfers counts 2 v m + 2 (p - 1):
    # an upper bound, by 5 transfers at most.
    x = 1e-3
    counted = (replay(p, v, m, 1.0, 2.0, x) - replay(p, v, m, 1.0, 2.0, 0.0)) / x
    assert 2 * v * m < counted <= F.pipeline_critical_transfers(p, m, v) <= counted + 5
