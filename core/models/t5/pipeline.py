"""What a T5 training step needs around its stages under pipeline parallelism: the group of
ranks holding a copy of the shared embedding, their gradient sum, and one pipelined step.

The embedding lives on stage 0 (encoder input), on the first decoder stage (decoder input) and,
when the output is tied, on the last stage. Each copy gets only its own part of the gradient;
`sync_t5_embedding_grads` sums them over `t5_embedding_group` so every copy takes the same
update and they stay equal (the copies after stage 0 are never saved, see `T5Model.global_name`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tessera.core.config import Layout, ModelConfig
from tessera.core.models.t5.layout import t5_stage_split
from tessera.core.models.t5.model import T5Model
from tessera.core.parallel.groups import ParallelGroups, rank_of


def embedding_stages(config: ModelConfig, num_stages: int, encoder_stages: int | None = None
                     ) -> list[int]:
    """The stages holding a copy of the shared embedding, ascending."""
    split = t5_stage_split(config, num_stages, encoder_stages)
    stages = {0, split if num_stages > 1 else 0}
    if config.tied_embeddings:
        stages.add(num_stages - 1)
    return sorted(stages)


def t5_embedding_group(config: ModelConfig, layout: Layout, groups: ParallelGroups,
                       encoder_stages: int | None = None) -> dist.ProcessGroup | None:
    """This rank's group of the ranks that hold embedding copies at its (tp, dp) coordinate;
    None where it holds none or the copies share one rank. Collective over the world (every
    rank must call it, in the same order), as `init_groups` is."""
    stages = embedding_stages(config, layout.num_stages, encoder_stages)
    if len(stages) == 1 or not dist.is_initialized():
        return None
    mine = None
    for d in range(layout.dp):
        for t in range(layout.tp):
            ranks = [rank_of(t, d, p, layout) for p in stages]  # one stage per pp rank
            group = dist.new_group(ranks)
            if groups.tp_rank == t and groups.dp_rank == d and groups.pp_rank in stages:
                mine = group
    return mine


def sync_t5_embedding_grads(stages: Sequence[T5Model], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the embedding copies over `group` (from `t5_embedding_group`)."""
    if group is None:
        return
    for m in stages:
        emb = m.embedding
        if emb is None or not emb.weight.requires_grad:
            continue
        if emb.weight.grad is None:
            emb.weight.grad = torch.zeros_like(emb.weight)
        dist.all_reduce(emb.weight.grad, group=group)


def t5_pipeline_step(schedule: Any, stages: Sequence[T5Model], groups: ParallelGroups,
                     encoder_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                     labels: torch.Tensor, encoder_mask: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """Forward and backward of one batch through a schedule built over T5 stages
    (`pipeline.build_schedule`, with `pipeline.pipeline_loss_fn`); gradients accumulate.

    Every rank passes the whole batch: `encoder_ids (B, S)` enter stage 0, `labels (B, T)` the
    loss on the last stage, and `decoder_input_ids (B, T)` / `encoder_mask (B, S)` are keywords
    that the schedule splits into micro-batches and hands to every stage. Returns the mean of
    the micro-batch losses on the last stage's rank, None elsewhere (`pipeline.broadcast_loss`).
    """
    first = any(m.is_first for m in stages)
    last = any(m.is_last for m in stages)
    losses: list[torch.Tensor] | None = [] if last else None
    extra = {} if encoder_mask is None else {"encoder_mask": encoder_mask}
    schedule.step(*((encoder_ids,) if first else ()), target=labels if last else None,
                  losses=losses, return_outputs=False, local_logits=True,
                  decoder_input_ids=decoder_input_ids, **extra)
    if not last:
        return None
    return torch.stack([loss.detach().float() for loss in losses]).mean()
