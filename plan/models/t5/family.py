"""The planner's model of T5 (`plan.models.registry`)."""

from __future__ import annotations

from tessera.plan.models.family import PlanFamily
from tessera.plan.models.t5 import estimate, rules

T5 = PlanFamily(
    memory=estimate.memory, step_time=estimate.step_time,
    step_flops=lambda job, recompute: estimate.step_flops(job),  # T5 never recomputes
    job_problems=rules.t5_job_problems, config_problems=rules.t5_config_problems,
    mode_problems=rules.t5_mode_problems, search_space=rules.t5_search_space,
    launch_flags=" --tokenizer TOKENIZER")  # span corruption puts sentinels above its tokens
