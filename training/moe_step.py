"""The training loop's two Mixture-of-Experts hooks (no-ops for dense models).

- `begin_moe_step(job)`, before a step's forward/backward: tells every MoE layer the factor its
  router-loss gradient is scaled by, the one the loop applies to the model loss before
  `backward()` (1 / micro-batches when it accumulates them itself; 1 under a pipeline schedule,
  which averages the gradients itself; times the fp16 loss scale), and starts recording the
  routing statistics (`core.moe.stats`). Refuses `moe.aux_loss_pooling = "model"` with pp > 1.
- `end_moe_step(job) -> dict`, after the optimizer step: the step's router metrics for
  metrics.jsonl (aux and z losses, tokens per expert min / max / CV, dropped tokens), and the
  aux-loss-free expert-bias update. Collective over the world for MoE models.
"""

from __future__ import annotations

from typing import Any

from tessera.core.config import ConfigError
from tessera.core.moe.losses import set_aux_loss_scale
from tessera.core.moe.stats import router_step_end, track_router_stats


def begin_moe_step(job: Any) -> None:
    """Set the MoE layers' aux-loss gradient scale and start recording (see the module)."""
    config = job.stages[0].config
    if not config.moe.num_experts:
        return
    if (config.moe.aux_loss_pooling == "model" and job.groups.pp_size > 1
            and job.stages[0].training):  # tuning runs the frozen base in eval: no router loss
        # Before the pipeline schedule runs (it would wrap the layers' own error).
        raise ConfigError(
            f"moe_aux_loss_pooling='model' (Hugging Face's load-balancing loss, the default of "
            f"imported HF models) pools every MoE layer's router statistics in one forward, but "
            f"pp={job.groups.pp_size} puts the layers on different stages; train with pp=1, or "
            f"set the model's moe_aux_loss_pooling to 'layer' (Megatron's per-layer loss)")
    scale = 1.0 if job.schedule is not None else 1.0 / job.plan.schedule.micro_batches
    if job.scaler is not None:
        scale *= float(job.scaler.get_scale())
    for stage in job.stages:
        set_aux_loss_scale(stage, scale)
    track_router_stats(job.stages)


def end_moe_step(job: Any) -> dict[str, float]:
    """The step's router metrics over all ranks ({} for a dense model)."""
    if not job.stages[0].config.moe.num_experts:
        return {}
    plan = job.plan
    return router_step_end(job.stages, job.groups, plan.layout.sequence_parallel,
                           plan.schedule.micro_batches)
