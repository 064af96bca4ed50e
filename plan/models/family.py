"""`PlanFamily`: what the planner asks of a model family. Torch-free, like all of the
planner's analytic model; it imports no family module.

The estimate functions take the planner's `estimate.Job` and `estimate.Config`; the rule
functions return messages (empty: nothing refused) that name the field and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.core.config import ModelConfig


def _none(model: ModelConfig, *args: Any, **kwargs: Any) -> list[str]:
    return []


def _no_space(model: ModelConfig) -> dict[str, list] | None:
    return None


@dataclass(frozen=True)
class PlanFamily:
    """One family as the planner models it.

    - `memory(job, c) -> estimate.Memory`, `step_time(job, c) -> estimate.StepTime`,
      `step_flops(job, recompute) -> float`: the estimates of one configuration;
    - `job_problems(model, precision)`: what a whole job asks that its training refuses;
    - `config_problems(model, recompute)`: what one configuration's schedule asks that its
      training refuses;
    - `mode_problems(model, serve=, measure=)`: planner modes that do not model it;
    - `search_space(model)`: the pp / virtual_stages / cp / recompute values worth enumerating
      when they differ from the decoder's rules (None: the decoder's);
    - `launch_flags`: what the printed `tessera pretrain` command needs beyond its config
      and data.
    """

    memory: Callable[..., Any]
    step_time: Callable[..., Any]
    step_flops: Callable[..., float]
    job_problems: Callable[[ModelConfig, str], list[str]] = _none
    config_problems: Callable[[ModelConfig, str], list[str]] = _none
    mode_problems: Callable[..., list[str]] = _none
    search_space: Callable[[ModelConfig], dict[str, list] | None] = _no_space
    launch_flags: str = ""
