"""What the pretraining loop does differently for T5 (family "t5"), through its objective's hooks
(`training.objectives.SPAN_CORRUPTION`): keeping the pipeline's embedding copies equal, and the
validation loss under pipeline parallelism. Its stages are built as every family's
(`core.init.build_model`).

- `t5_embedding_sync`: made once at setup (collective over the world, as `init_groups`); the
  step calls it in place of `pipeline.sync_tied_embedding_grads`, summing the gradients of the
  embedding copies held by the encoder's first stage, the decoder's first stage and (tied) the
  last stage.
- `t5_pipeline_eval_loss`: the validation loss through the training schedule run forward only
  (`schedule.eval`), since `pipeline_forward` passes one hidden tensor between stages and T5
  stages pass several (hidden states, position biases, encoder output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tessera.core.models.t5.model import T5Model
from tessera.core.models.t5.pipeline import sync_t5_embedding_grads, t5_embedding_group
from tessera.core.parallel.groups import ParallelGroups


def t5_embedding_sync(plan: Any, groups: ParallelGroups, stages: list[T5Model]
                      ) -> Callable[[], None]:
    """The per-step gradient sum of the embedding copies; every rank must call this once, in
    the same order (it creates process groups)."""
    group = t5_embedding_group(plan.model, plan.layout, groups)
    return lambda: sync_t5_embedding_grads(stages, group)


@torch.no_grad()
def t5_pipeline_eval_loss(schedule: Any, stages: list[T5Model], encoder_ids: torch.Tensor,
                          labels: torch.Tensor, extra: dict[str, torch.Tensor]
                          ) -> torch.Tensor | None:
    """The loss of one batch through `schedule` without backward, on the rank of the last stage
    (None elsewhere; `pipeline.broadcast_loss` shares it): the micro-batch means weighted by
    their label counts, so it is the batch's mean over its labels as one forward gives it."""
    first = any(m.is_first for m in stages)
    last = any(m.is_last for m in stages)
    losses: list[torch.Tensor] | None = [] if last else None
    schedule.eval(*((encoder_ids,) if first else ()), target=labels if last else None,
                  losses=losses, return_outputs=False, local_logits=True, **extra)
    if not last:
        return None
    counts = torch.stack([(mb != -100).sum() for mb in labels.chunk(len(losses))]).float()
    return (torch.stack([loss.float() for loss in losses]) * counts).sum() / counts.sum()
