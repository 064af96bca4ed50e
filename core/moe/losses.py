"""The router's auxiliary losses, and how their gradient joins the training loss.

- Load balancing (Switch Transformer eq. 4-6, as Hugging Face computes it for Mixtral and
  Qwen2-MoE): `E * sum_e f_e * P_e`, with `f_e` the share of the N tokens' top-k choices that
  went to expert e (counted before capacity dropping, so it sums to k over e) and `P_e` the mean
  router score of expert e. 1 x k at perfect balance.
  This is `moe.aux_loss_pooling = "layer"`, averaged over the MoE layers; `"model"` pools the
  statistics of all MoE layers into one loss as Hugging Face does (`core.moe.pooled_aux`).
- Router z-loss (ST-MoE, Zoph et al. 2022): `mean_t logsumexp(logits_t)^2`.

Under sequence parallelism each tp rank routes its own chunk of the sequence; both losses are
then computed on the whole sequence: the counts are summed over the group (they carry no
gradient), and each rank returns its chunk's share of the sums, `/ N` with N the tokens of all
chunks. The shares add up to the global loss, so summing the router gradient over tp (as for
every sequence-parallel replicated weight) gives exactly the single-process gradient.

The losses live inside the MoE layers, which may sit on any pipeline stage, while the model's
loss is computed on the last one. So, as Megatron does (`MoEAuxLossAutoScaler`), the layer
attaches its loss to its output with `attach_aux_loss`: the forward value passes unchanged, and
the backward adds `scale * d(aux)` to the router's gradient. `scale` is what the caller
multiplies the model loss by before `backward()` (1 / micro-batches with gradient accumulation,
times the fp16 loss scale): `set_aux_loss_scale` sets it on every MoE layer of a model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def load_balancing_loss(scores: torch.Tensor, chosen: torch.Tensor, num_experts: int,
                        group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None,
                        group_size: int = 1) -> torch.Tensor:
    """This rank's share of `E * sum_e f_e P_e` over the tokens of all `group` ranks.

    `scores (n, E)` fp32 (rows sum to 1), `chosen (n, k)` the top-k experts before dropping.
    With `group` (sequence parallelism; or a tuple of orthogonal groups, tp and cp, whose
    product holds the sequence) every rank holds n tokens of the same sequence, `group_size`
    ranks in all.
    """
    n = scores.shape[0] * group_size
    counts = routed_counts(chosen, num_experts, group)
    return torch.sum((counts / n) * (scores.sum(dim=0) / n)) * num_experts


def routed_counts(chosen: torch.Tensor, num_experts: int,
                  group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None
                  ) -> torch.Tensor:
    """`(E,)` fp32 top-k choices per expert (before dropping), summed over `group` (as in
    `load_balancing_loss`); no gradient."""
    counts = torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
    for g in (group if isinstance(group, tuple) else (group,)):
        if g is not None:
            dist.all_reduce(counts, group=g)
    return counts


def z_loss(logits: torch.Tensor, group_size: int = 1) -> torch.Tensor:
    """This rank's share of `mean_t logsumexp(logits_t)^2` over `group_size` equal chunks."""
    return torch.logsumexp(logits, dim=-1).square().sum() / (logits.shape[0] * group_size)


class _AttachAux(torch.autograd.Function):
    """`x` unchanged forward; backward also sends gradient `scale` into the scalar `aux`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """`x`, whose backward also backpropagates `scale * aux` (see the module docstring)."""
    if not aux.requires_grad or scale == 0.0:
        return x
    return _AttachAux.apply(x, aux, scale)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set on every MoE layer of `model` the factor its aux-loss gradient is scaled by: the one
    the caller applies to the model's loss before `backward()`."""
    for module in model.modules():
        if hasattr(module, "aux_loss_scale"):
            module.aux_loss_scale = scale
