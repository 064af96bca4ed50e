"""`tessera plan`: pick the parallel layout, micro-batch and recomputation for a model on a
cluster, from an analytic model (instant, no torch) that a measured mode can confirm.

    from tessera.plan import TrainingJob, Fixed, plan_training, load_hardware
    job = TrainingJob(ModelConfig.from_name("gpt3-175b"), gpus=1024,
                      hardware=load_hardware("a100-80gb"), global_batch=1536, seq_len=2048,
                      tokens=300e9)
    best = plan_training(job, top=5)[0]

Modules: `formulas` (the papers' formulas, each cited), `hardware` (profiles), `estimate`
(memory and step time of one configuration), `search` (enumerate and rank), `serving`.
"""

from __future__ import annotations

from tessera.plan.errors import PlanError
from tessera.plan.estimate import Memory, StepTime
from tessera.plan.hardware import PROFILES, Hardware, load_hardware
from tessera.plan.search import (
    MODEL_ERROR,
    Candidate,
    Fixed,
    TrainingJob,
    evaluate,
    explain,
    within_model_error,
)
from tessera.plan.serving import ServingOption, ServingPlan, plan_serving
from tessera.plan.training_plan import plan_training

__all__ = [
    "MODEL_ERROR",
    "PROFILES",
    "Candidate",
    "Fixed",
    "Hardware",
    "Memory",
    "PlanError",
    "ServingOption",
    "ServingPlan",
    "StepTime",
    "TrainingJob",
    "evaluate",
    "explain",
    "load_hardware",
    "plan_serving",
    "plan_training",
    "within_model_error",
]
