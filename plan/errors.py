"""The one error the planner raises for bad input or a job that nothing fits."""

from __future__ import annotations


class PlanError(ValueError):
    """A planning request that cannot be answered: unknown hardware, a GPU count that does not
    split into nodes, or a model that fits no configuration. The message says what is wrong and
    what would work instead (more GPUs, a larger card, another precision)."""
