"""Hugging Face's load-balancing loss: one Switch loss over the tokens of every MoE layer.

`MoEConfig.aux_loss_pooling = "model"`. Hugging Face (`load_balancing_loss_func` of
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) concatenates the router logits of the L MoE layers of one
forward and computes a single loss over the L x N rows (N tokens per layer):

    aux = E * sum_e F_e * P_e,   F_e = C_e / (L N),   P_e = S_e / (L N)

where `C_e` counts the top-k choices of expert e (before capacity dropping, so sum_e F_e = k)
and `S_e` sums e's router score, both over all layers and tokens. The per-layer loss
(`"layer"`, `core.moe.losses`) is instead the mean over layers of each layer's own
`E * sum_e f_e p_e`; the two agree with one MoE layer only.

F carries no gradient, so `aux = sum_l E * sum_e F_e * S_{l,e} / (L N)`: layer l's term is linear
in its own score sums `S_l`, with coefficients known once every layer has routed. The backward
pass runs after the whole forward, so each layer attaches `S_l` to its output
(`attach_pooled_aux`) with a function whose backward reads the finished counts from the
forward's `AuxPool`: `d aux / d S_{l,e} = E * C_e / (L N)^2`. No layer needs another's graph,
so activation recomputation (non-reentrant: the original forward's nodes run the backward)
changes nothing.

One pool per training forward, started by the model's first MoE layer and joined by the others
(a thread-local "current pool"); recomputation inside backward neither starts nor joins one, it
reuses the layer's pool. This needs all MoE layers in one forward: pipeline parallelism
(`pp > 1`) puts them on different stages and is refused at the first training forward.

Sequence parallelism (tp) and context parallelism split a sequence's tokens over ranks, as for
the per-layer loss: the counts are summed over those ranks (each layer already all-reduces its
own; the pool adds them up), N counts the tokens of all of them, and each rank's `S_l` covers
its own tokens, so the ranks' terms add up to the loss of the whole sequence. Data and expert
parallelism: one loss per rank's micro-batch, as Hugging Face computes one per batch.

Hugging Face also weights rows by the attention mask when one is given; Tessera trains on
unpadded (packed) sequences, i.e. Hugging Face's call without `attention_mask`.
"""

from __future__ import annotations

import threading

import torch

_current = threading.local()


class AuxPool:
    """The pooled router statistics of one training forward of one model."""

    def __init__(self, owner: object, layers: list[int], num_experts: int,
                 device: torch.device):
        self.owner, self.layers, self.num_experts = owner, list(layers), num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.score_sums: dict[int, torch.Tensor] = {}  # layer -> this rank's S_l, detached
        self.rows = 0  # L x N once complete (N: a layer's tokens over the sequence's ranks)
        # Each layer's share of the loss (this rank's), filled in place once complete: the
        # routing records hold views of it (`core.moe.stats`).
        self.terms = torch.zeros(len(self.layers), dtype=torch.float32, device=device)

    @property
    def complete(self) -> bool:
        return len(self.score_sums) == len(self.layers)

    def add(self, layer: int, counts: torch.Tensor, score_sum: torch.Tensor, tokens: int) -> None:
        """Layer `layer`'s top-k counts (summed over the sequence's ranks), its score sums over
        this rank's tokens, and the sequence's token count."""
        if layer in self.score_sums:
            raise RuntimeError(f"MoE layer {layer} routed twice in one forward; pooled "
                               "load-balancing needs each MoE layer once per forward")
        self.counts += counts
        self.score_sums[layer] = score_sum.detach()
        self.rows += tokens
        if self.complete:
            sums = torch.stack([self.score_sums[i] for i in self.layers])  # (L, E)
            self.terms.copy_((sums * self.gradient()).sum(dim=1))

    def gradient(self) -> torch.Tensor:
        """`d aux / d S_{l,e} = E * C_e / (L N)^2`, the same for every layer."""
        return self.counts * (self.num_experts / float(self.rows) ** 2)


def pool_for_layer(owner: object, layers: list[int], layer: int, num_experts: int,
                   device: torch.device) -> AuxPool:
    """The pool of the current training forward of `owner` (the model's config): a new one at
    its first MoE layer, the running one at the others."""
    if layer == layers[0]:
        _current.pool = AuxPool(owner, layers, num_experts, device)
        return _current.pool
    pool = getattr(_current, "pool", None)
    if pool is None or pool.owner is not owner or layer in pool.score_sums:
        raise RuntimeError(
            f"MoE layer {layer} ran without the model's first MoE layer {layers[0]} before it in "
            "the same forward; moe_aux_loss_pooling='model' needs every MoE layer in one "
            "forward (pp = 1). Use moe_aux_loss_pooling='layer' otherwise")
    return pool


class _AttachPooled(torch.autograd.Function):
    """`x` unchanged forward; backward sends `weight * d aux / d S_l` into `score_sum`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, score_sum: torch.Tensor, pool: AuxPool,
                weight: float) -> torch.Tensor:
        ctx.pool, ctx.weight = pool, weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pool = ctx.pool
        if not pool.complete:
            missing = sorted(set(pool.layers) - set(pool.score_sums))
            raise RuntimeError(f"pooled load-balancing loss: MoE layers {missing} did not run "
                               "in this forward; moe_aux_loss_pooling='model' needs every MoE "
                               "layer in one forward")
        return grad, pool.gradient() * ctx.weight, None, None


def attach_pooled_aux(x: torch.Tensor, score_sum: torch.Tensor, pool: AuxPool,
                      weight: float) -> torch.Tensor:
    """`x`, whose backward also backpropagates `weight * aux` through this layer's score sums
    `score_sum (E,)` (see the module docstring)."""
    if not score_sum.requires_grad or weight == 0.0:
        return x
    return _AttachPooled.apply(x, score_sum, pool, weight)
