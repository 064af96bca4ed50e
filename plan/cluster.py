"""GPU counts the planner accepts.

Training and serving plans share these rules, so a cluster that one refuses the other refuses
with the same words.
"""

from __future__ import annotations

from tessera.plan.errors import PlanError


def fills_whole_nodes(gpus: int, gpus_per_node: int) -> bool:
    """Whether `gpus` is part of one node or a whole number of nodes (the counts a plan takes)."""
    return gpus <= gpus_per_node or gpus % gpus_per_node == 0


def check_gpu_count(gpus: int, gpus_per_node: int) -> None:
    """Raise PlanError unless `gpus` is part of one node or a whole number of nodes.

    A job smaller than a node may use part of it; beyond one node, a count that is not a
    multiple of the node size describes no real cluster, so the message names the nearest
    counts that do, and the flag that says how many GPUs a node really has.
    """
    if gpus < 1 or gpus_per_node < 1:
        raise PlanError(f"gpus ({gpus}) and gpus_per_node ({gpus_per_node}) must be >= 1")
    if not fills_whole_nodes(gpus, gpus_per_node):
        lo = gpus // gpus_per_node * gpus_per_node
        raise PlanError(f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes; use "
                        f"{lo} or {lo + gpus_per_node}, or give the GPUs a node really has "
                        "(gpus_per_node; --gpus-per-node on the command line)")
