"""Gradient reduction and the global gradient norm under expert parallelism:
the checks `test_expert_parallel` runs on 4 ranks.

A toy model (a replicated scale vector `norm.weight`, then the all-to-all dispatcher into the
toy expert bank `layers.0.feed_forward.experts.w1` / `.w2`) runs each of 4 ranks' own tokens;
after `allreduce_gradients` the dense gradient (averaged over dp x cp) and every rank's expert
piece (summed over its expert-data-parallel group, over dp x cp) must equal the one-process
gradient of the mean loss (ep2 with edp 2, ep2 x etp2, ep2 over dp2 x cp2). Then, with known
gradients placed on every rank, `training.optim.global_grad_norm` must equal the one-process
norm under ep x tp layouts (etp 1, where ep folds over the tp peers, and etp 2 = tp), and with
edp 2, where Megatron once undercounted.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.core.config import Layout, ModelConfig
from tessera.core.moe.config import MoEConfig
from tessera.core.parallel.data_parallel import allreduce_gradients
from tessera.core.parallel.expert_parallel import make_expert_parallel_dispatcher
from tessera.core.parallel.groups import ParallelGroups, init_groups
from tessera.core.parallel.sharding import expert_global_shape, shard_expert_tensor
from tests.distributed._expert_toy import close, routing, toy_experts

E, F, H = 8, 6, 4
CONFIG = ModelConfig(hidden_size=H, num_heads=2, ffn_hidden_size=F, activation="gelu",
                     moe=MoEConfig(num_experts=E))
BANKS = ["layers.0.feed_forward.experts.w1", "layers.0.feed_forward.experts.w2"]


def _globals(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(expert_global_shape(n, CONFIG), generator=gen, dtype=torch.float64)
           for n in BANKS}
    out["norm.weight"] = torch.randn(H, generator=gen, dtype=torch.float64)
    return out


class Toy(nn.Module):
    """`norm.weight` (replicated) and this rank's pieces of the two expert banks."""

    def __init__(self, groups: ParallelGroups, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config, self.groups = CONFIG, groups
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(values["norm.weight"].clone())
        self.layers = nn.ModuleDict({"0": nn.Module()})
        self.layers["0"].feed_forward = nn.Module()
        experts = self.layers["0"].feed_forward.experts = nn.Module()
        for name in BANKS:
            piece = self.piece(name, values[name])
            experts.register_parameter(name.rsplit(".", 1)[1], nn.Parameter(piece.clone()))

    def piece(self, name: str, full: torch.Tensor) -> torch.Tensor:
        g = self.groups
        return shard_expert_tensor(name, full, CONFIG, g.ep_rank, g.ep_size, g.etp_rank,
                                   g.etp_size)

    def global_name(self, local_name: str) -> str:
        return local_name

    def forward(self, x, ids, weights, dispatcher):
        experts = self.layers["0"].feed_forward.experts
        xs, counts = dispatcher.dispatch(x * self.norm.weight, ids, weights)
        return dispatcher.combine(toy_experts(xs, counts, experts.w1, experts.w2))


def _loss(rank: int, out: torch.Tensor) -> torch.Tensor:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(500 + rank),
                        dtype=torch.float64)
    return (out * probe).sum()


def _reference_grads(world: int, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The one-process gradient of the mean over ranks of their losses, all experts local."""
    params = {n: v.clone().requires_grad_() for n, v in values.items()}
    total = 0.0
    for r in range(world):
        x, ids, weights = routing(r)
        x = x * params["norm.weight"]
        out = torch.zeros_like(x)
        w1, w2 = params[BANKS[0]], params[BANKS[1]]
        for e in range(E):
            for j in range(ids.shape[1]):
                rows = (ids[:, j] == e).nonzero().squeeze(1)
                y = torch.tanh(x[rows] @ w1[e].T) @ w2[e].T
                out = out.index_add(0, rows, y * weights[rows, j:j + 1])
        total = total + _loss(r, out)
    (total / world).backward()
    return {n: p.grad for n, p in params.items()}


def check_reduction(rank: int, world: int, layout: Layout, ref: dict, values: dict) -> None:
    groups = init_groups(layout)
    model = Toy(groups, values)
    x, ids, weights = routing(rank)
    _loss(rank, model(x, ids, weights, make_expert_parallel_dispatcher(groups, E))).backward()
    allreduce_gradients([model], groups)
    name = f"{layout} rank {rank}"
    params = dict(model.named_parameters())
    close(params["norm.weight"].grad, ref["norm.weight"], name + " norm.weight")
    for bank in BANKS:
        close(params[bank].grad, model.piece(bank, ref[bank]), f"{name} {bank}")


def check_norm(rank: int, world: int, layout: Layout) -> float:
    from tessera.training.optim import global_grad_norm

    groups = init_groups(layout)
    grads = _globals(9)
    model = Toy(groups, _globals(1))
    for n, p in model.named_parameters():
        p.grad = model.piece(n, grads[n]) if n in BANKS else grads[n].clone()
    want = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    got = float(global_grad_norm([model]))
    assert abs(got - want) <= 1e-6 * want, (str(layout), got, want)  # an fp32 norm
    return got


def check_gradients(rank: int, world: int) -> None:
    """The reduction under ep2 (edp 2), ep2 x etp2 and ep2 over dp2 x cp2, then the norm under
    tp2 x ep2 (etp 1 and 2) and ep2 with edp 2."""
    values = _globals(1)
    ref = _reference_grads(world, values)
    for layout in (Layout(dp=4, ep=2), Layout(dp=4, ep=2, etp=2), Layout(dp=2, cp=2, ep=2)):
        check_reduction(rank, world, layout, ref, values)
    for layout in (Layout(tp=2, dp=2, ep=2, sequence_parallel=True),
                   Layout(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True),
                   Layout(dp=4, ep=2)):
        check_norm(rank, world, layout)
