"""The toy of the expert-parallel tests: each rank's tokens and routing, a toy
expert bank, and the dispatcher check against a one-process reference.

Each rank routes its own tokens (uneven counts, one rank with none, dropped assignments, one
expert nobody picks) through a dispatcher into a toy expert bank (per-expert `w1 (E, F, h)`,
`w2 (E, h, F)`, a tanh between, applied by a loop over the local experts), and back. The
reference runs every rank's tokens through every expert in one process, without permutation
or communication. Forward outputs, the gradients of the inputs and routing weights, the
gradients of this rank's expert shard, and the per-expert counts must match (fp64, 1e-12).
"""

from __future__ import annotations

import torch

from tessera.core.config import Layout
from tessera.core.parallel.expert_parallel import make_expert_parallel_dispatcher
from tessera.core.parallel.groups import init_groups

E, F, H, K = 8, 6, 4, 2
UNUSED = 3  # no token picks this expert
TOKENS = [5, 0, 7, 3]  # per rank: uneven, rank 1 has none


def routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens, expert ids (k distinct per token, ~25% dropped as -1) and weights."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = TOKENS[rank]
    x = torch.randn(n, H, generator=gen, dtype=torch.float64)
    experts = torch.tensor([e for e in range(E) if e != UNUSED])
    ids = torch.stack([experts[torch.randperm(len(experts), generator=gen)[:K]]
                       for _ in range(n)]) if n else torch.empty(0, K, dtype=torch.int64)
    drop = torch.rand(n, K, generator=gen) < 0.25
    if n:
        drop[0] = True  # a token with every assignment dropped
    ids = ids.masked_fill(drop, -1)
    weights = torch.rand(n, K, generator=gen, dtype=torch.float64)
    return x, ids, weights


def _bank() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(E, F, H, generator=gen, dtype=torch.float64),
            torch.randn(E, H, F, generator=gen, dtype=torch.float64))


def toy_experts(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
                ) -> torch.Tensor:
    """Rows grouped by expert (`counts[e]` for expert e) through expert e's `w2 tanh(w1 x)`."""
    outs = [torch.tanh(rows @ w1[e].T) @ w2[e].T
            for e, rows in enumerate(xs.split(counts.tolist()))]
    return torch.cat(outs) if outs else xs.new_zeros(0, w2.shape[1])


def close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    # Not torch.testing.assert_close: its first call imports DTensor (seconds in every rank).
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-12, f"{name}: max abs diff {err}"


def check_dispatch(rank: int, world: int, layout: Layout, kind: str) -> None:
    groups = init_groups(layout)
    disp = make_expert_parallel_dispatcher(groups, E, kind)
    local, off = disp.num_local_experts, disp.local_expert_offset
    assert local == E // layout.ep and off == groups.ep_rank * local
    f_lo, f_hi = groups.etp_rank * F // layout.etp, (groups.etp_rank + 1) * F // layout.etp
    full1, full2 = _bank()
    w1 = full1[off:off + local, f_lo:f_hi].clone().requires_grad_()
    w2 = full2[off:off + local, :, f_lo:f_hi].clone().requires_grad_()
    x, ids, weights = routing(rank)
    x.requires_grad_(), weights.requires_grad_()
    seeds = torch.Generator().manual_seed(1000 + rank)
    probe = torch.randn(x.shape, generator=seeds, dtype=torch.float64)

    xs, counts = disp.dispatch(x, ids, weights)
    out = disp.combine(toy_experts(xs, counts, w1, w2))
    (out * probe).sum().backward()

    # The reference: every rank's tokens, all experts, one process.
    r1, r2 = full1.clone().requires_grad_(), full2.clone().requires_grad_()
    refs = []
    for r in range(world):
        rx, _, rw = routing(r)
        refs.append((rx.requires_grad_(), rw.requires_grad_()))
    ref_outs = reference_outputs(refs, r1, r2)
    loss = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(1000 + r),
                                dtype=torch.float64)).sum() for r, o in enumerate(ref_outs))
    loss.backward()
    name = f"{kind} ep{layout.ep} etp{layout.etp} rank {rank}"
    all_ids = torch.cat([routing(r)[1].reshape(-1) for r in range(world)])
    expect = torch.bincount(all_ids[all_ids >= 0], minlength=E)[off:off + local]
    assert torch.equal(counts, expect), (name, counts, expect)
    assert int(counts.sum()) == xs.shape[0], name
    close(out, ref_outs[rank].detach(), name)
    close(x.grad, refs[rank][0].grad, name)
    close(weights.grad, refs[rank][1].grad, name)
    close(w1.grad, r1.grad[off:off + local, f_lo:f_hi], name)
    close(w2.grad, r2.grad[off:off + local, :, f_lo:f_hi], name)
    if UNUSED in range(off, off + local):
        assert counts[UNUSED - off] == 0 and w1.grad[UNUSED - off].abs().sum() == 0, name


def reference_outputs(refs, w1, w2) -> list[torch.Tensor]:
    outs = []
    for r, (x, weights) in enumerate(refs):
        ids = routing(r)[1]
        out = torch.zeros_like(x)
        for e in range(E):
            for j in range(K):
                rows = (ids[:, j] == e).nonzero().squeeze(1)
                y = torch.tanh(x[rows] @ w1[e].T) @ w2[e].T
                out = out.index_add(0, rows, y * weights[rows, j:j + 1])
        outs.append(out)
    return outs


def check_dispatchers(rank: int, world: int, layouts: list[tuple[int, int]]) -> None:
    """Both dispatchers under each `(ep, etp)` of `layouts`, over `world` data-parallel ranks."""
    for ep, etp in layouts:
        for kind in ("alltoall", "allgather"):
            check_dispatch(rank, world, Layout(dp=world, ep=ep, etp=etp), kind)
