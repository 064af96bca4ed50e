"""The Mixture-of-Experts feed-forward block that replaces the dense MLP in MoE layers.

`MoEFeedForward(x)` takes the FFN input `(T, B, C)` (`(T / tp, B, C)` under sequence
parallelism) and returns the same shape:

    routing = router(x)                                    # core.moe.router
    xs, counts = dispatcher.dispatch(x, routing.expert_ids, routing.weights)
    out = dispatcher.combine(experts(xs, counts))         # core.moe.dispatch, core.moe.experts
    out += sigmoid(x @ shared_expert_gate^T) * shared_expert(x)   # Qwen2-MoE, when configured
    out += shared_expert(x)                # DeepSeek's ungated shared experts, when configured

Tensor parallelism at expert parallelism 1: the router and the routed experts are replicated
over tp and run on the tokens this rank holds. Without sequence parallelism every tp rank holds
every token, computes the same and needs no communication; with it each rank routes its own
chunk, so these weights' gradients are partial and are marked `sequence_parallel` (summed over
tp after backward, `pipeline.sync_sequence_parallel_grads`), and the aux losses are computed
over the whole sequence (`core.moe.losses`). The shared expert is split over tp like the dense
MLP (column-parallel `w1`, row-parallel `w2`).

The load-balancing and z losses, weighted by `moe.aux_loss_coef` / `moe.z_loss_coef` and
averaged over the model's MoE layers (with `moe.aux_loss_pooling = "model"` the load-balancing
loss is instead one loss pooled over every MoE layer, `core.moe.pooled_aux`), join the
training loss through the layer's output (`losses.attach_aux_loss`, scaled by
`aux_loss_scale`), unless the router is frozen (prompt tuning: the router losses must not train
the prompt). Each training forward (not the recomputation of activation checkpointing) appends
one `RouterRecord` to `records`, for the step's metrics and the expert-bias update while `track`
is on (`core.moe.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.core.config import ConfigError
from tessera.core.moe.dispatch import make_dispatcher
from tessera.core.moe.experts import GroupedExperts, activate
from tessera.core.moe.losses import attach_aux_loss, load_balancing_loss, routed_counts, z_loss
from tessera.core.moe.pooled_aux import AuxPool, attach_pooled_aux, pool_for_layer
from tessera.core.moe.router import Router
from tessera.core.moe.shapes import moe_ffn_size, moe_layers
from tessera.core.parallel.expert_parallel import DISPATCHERS
from tessera.core.parallel.layers import ColumnParallelLinear, RowParallelLinear


@dataclass
class RouterRecord:
    """One training forward of one MoE layer on this rank (tensors detached)."""

    layer: int
    counts: torch.Tensor  # (E,) int64 assignments kept per expert (what the experts ran)
    dropped: torch.Tensor  # () int64 assignments dropped by capacity
    aux_loss: torch.Tensor  # () fp32 this rank's share of the load-balancing loss (no coef)
    z_loss: torch.Tensor  # () fp32 this rank's share of the z-loss (no coef)


class SharedExpert(nn.Module):
    """A dense MLP of `moe.shared_ffn_hidden_size`, split over tp like the model's MLP."""

    def __init__(self, hidden: int, ffn: int, activation: str, groups, sp: bool):
        super().__init__()
        tp, gated = groups.tp_size, activation == "swiglu"
        self.activation = activation
        self.w1 = ColumnParallelLinear(hidden, ffn * (2 if gated else 1) // tp, False,
                                       groups.tp_group, sp)
        self.w2 = RowParallelLinear(ffn // tp, hidden, False, groups.tp_group, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(activate(self.w1(x), self.activation))


class MoEFeedForward(nn.Module):
    """Router, routed experts, optional (gated) shared expert (see the module docstring)."""

    def __init__(self, config, layer: int, groups, sp: bool):
        super().__init__()
        c = config
        self.config, self.layer, self.num_experts, self.sp = c, layer, c.moe.num_experts, sp
        self.tp_group = groups.tp_group if sp else None
        self.tp_size = groups.tp_size if sp else 1
        # The ranks sharing one sequence's tokens for the router losses: tp under SP, and cp.
        # A cp rank's share is scaled by cp, as the LM loss's is (`context_parallel.
        # global_mean_loss`): gradients are averaged over dp x cp.
        self.cp_size = groups.cp_size
        self.seq_groups = tuple(x for x in (self.tp_group, groups.cp_group) if x is not None)
        n_moe = len(moe_layers(c))
        self.aux_coef, self.z_coef = c.moe.aux_loss_coef / n_moe, c.moe.z_loss_coef / n_moe
        # `moe.aux_loss_pooling = "model"`: one load-balancing loss over every MoE layer's
        # tokens, as Hugging Face computes it (`core.moe.pooled_aux`); the coefficient is then
        # not divided by the layers.
        self.pooled = c.moe.aux_loss_pooling == "model"
        self.moe_layer_ids, self.pp_size = moe_layers(c), groups.pp_size
        self.aux_pool: AuxPool | None = None  # this layer's last training forward's pool
        self.aux_loss_scale = 1.0  # set by the training loop (`losses.set_aux_loss_scale`)
        # Training forwards append here while `track` is on (`stats.track_router_stats`).
        self.track, self.records = False, []
        self.router = Router(c.hidden_size, c.moe.num_experts, c.moe.top_k,
                             score=c.moe.router_score, norm_topk=c.moe.norm_topk,
                             capacity_factor=c.moe.capacity_factor,
                             expert_bias=c.moe.expert_bias, routed_scale=c.moe.routed_scale,
                             num_groups=c.moe.num_groups, topk_groups=c.moe.topk_groups,
                             group_score=c.moe.group_score)
        self.dispatcher = make_dispatcher(groups, c)
        # Expert parallelism: this rank's E / ep experts, each FFN sliced over etp.
        expert_grid = groups.ep_size * groups.etp_size > 1
        self.experts = GroupedExperts(self.dispatcher.num_local_experts, c.hidden_size,
                                      moe_ffn_size(c) // groups.etp_size, c.activation)
        self.shared_expert = self.shared_expert_gate = None
        if c.moe.shared_ffn_hidden_size:
            self.shared_expert = SharedExpert(c.hidden_size, c.moe.shared_ffn_hidden_size,
                                              c.activation, groups, sp)
            if c.moe.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        replicated = [self.router.weight]
        if not expert_grid:  # else expert pieces: gradients reduced over edp, never over tp
            replicated += self.experts.parameters()
        if self.shared_expert_gate is not None:
            replicated.append(self.shared_expert_gate.weight)
        for p in replicated:
            # Each tp rank routes its own sequence chunk under SP: gradients summed over tp.
            p.sequence_parallel = sp

    def set_dispatcher(self, groups, kind: str) -> None:
        """Move tokens with the expert-parallel dispatcher `kind` ("alltoall", "allgather";
        `TrainSchedule.moe_dispatcher`); no change at expert parallelism 1."""
        self.dispatcher = make_dispatcher(groups, self.config, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (n, C)
        routing = self.router(flat)
        xs, counts = self.dispatcher.dispatch(flat, routing.expert_ids, routing.weights)
        out = self.dispatcher.combine(self.experts(xs, counts)).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(x).reshape(flat.shape)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = out.reshape(shape)
        if not self.training:
            return out
        if self.pooled:  # this rank's share of the model-wide loss, known once all layers ran
            score_sum = self._join_pool(routing, flat.shape[0])
            aux = self.aux_pool.terms[self.moe_layer_ids.index(self.layer)]
        else:
            aux = load_balancing_loss(routing.scores, routing.chosen, self.num_experts,
                                      self.seq_groups or None, self.tp_size * self.cp_size)
        z = z_loss(routing.logits, self.tp_size * self.cp_size)
        # Not the recomputation of activation checkpointing (inside backward), nor the pipeline
        # schedule's shape inference (meta tensors, no grad).
        if (self.track and torch.is_grad_enabled() and not flat.is_meta
                and torch._C._current_graph_task_id() == -1):
            kept = routing.expert_ids.reshape(-1)
            self.records.append(RouterRecord(
                self.layer, torch.bincount(kept[kept >= 0], minlength=self.num_experts),
                (kept < 0).sum(), aux.detach(), z.detach()))
        if torch.is_grad_enabled() and self.router.weight.requires_grad:  # not when frozen
            if self.pooled:
                if self.z_coef:
                    out = attach_aux_loss(out, self.z_coef * z * self.cp_size,
                                          self.aux_loss_scale)
                weight = self.config.moe.aux_loss_coef * self.cp_size * self.aux_loss_scale
                return attach_pooled_aux(out, score_sum, self.aux_pool, weight)
            out = attach_aux_loss(out, (self.aux_coef * aux + self.z_coef * z) * self.cp_size,
                                  self.aux_loss_scale)
        return out

    def _join_pool(self, routing, n_local: int) -> torch.Tensor:
        """Add this layer's routing to the forward's `AuxPool` (not when recomputing inside
        backward: the original forward did); return its score sums `(E,)` with gradient."""
        score_sum = routing.scores.sum(dim=0)
        if torch._C._current_graph_task_id() != -1 and self.aux_pool is not None:
            return score_sum
        if self.pp_size > 1:
            raise ConfigError(
                f"moe_aux_loss_pooling='model' pools the router statistics of all "
                f"{len(self.moe_layer_ids)} MoE layers in one forward, but pp={self.pp_size} puts "
                f"them on different stages; train with pp=1 or set "
                f"moe_aux_loss_pooling='layer' (Megatron's per-layer loss)")
        self.aux_pool = pool_for_layer(self.config, self.moe_layer_ids, self.layer,
                                       self.num_experts, score_sum.device)
        counts = routed_counts(routing.chosen, self.num_experts, self.seq_groups or None)
        self.aux_pool.add(self.layer, counts, score_sum,
                          n_local * self.tp_size * self.cp_size)
        return score_sum


def set_dispatchers(model: nn.Module, groups, kind: str) -> None:
    """Give every MoE layer of `model` the token dispatcher `kind` ("alltoall" or "allgather",
    `TrainSchedule.moe_dispatcher`); only expert-parallel layers change."""
    if kind not in DISPATCHERS:
        raise ValueError(f"unknown MoE token dispatcher {kind!r}; choose one of "
                         f"{list(DISPATCHERS)}")
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.set_dispatcher(groups, kind)
