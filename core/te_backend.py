"""Optional Transformer Engine backend: swap the block linears for `te.pytorch.Linear`.

Used only on CUDA when `transformer_engine` imports (`pip install --no-build-isolation
"tessera[te]"`); nothing requires it. TE's `Linear` takes the same explicit tp group, the same
column/row split and the same sequence-parallel flag, and names its tensors `weight` and `bias`
with the same local shapes, so checkpoints, the sharding rules and the optimizer see exactly the
parameters of the plain-PyTorch backend; the swap copies them into the TE modules. Which layers
are swapped is the rule every low-precision path shares, `weight_format.quantizable`.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.core.parallel.layers import quantizable_linears
from tessera.core.parallel.weight_format import Dense


def transformer_engine_available(device: torch.device | str) -> bool:
    """True when TE imports and `device` is CUDA (TE kernels exist only there)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return False
    return True


@torch.no_grad()
def apply_transformer_engine(model: nn.Module) -> int:
    """Replace every linear `quantizable` names (the block linears, dense) by a TE Linear with
    the same parameters; return how many.

    The output projection stays a plain layer: its product reads the weight directly (it may be
    the tied embedding), so a TE module there would only hold the tensor.
    """
    import transformer_engine.pytorch as te

    swaps = quantizable_linears(model)
    for name, old in swaps:
        if not isinstance(old.format, Dense):
            raise ValueError(f"{name} holds {old.format!r} weights; Transformer Engine takes "
                             "dense ones (apply it before quantizing)")
        column = old.parallel == "column"
        tp_size = 1 if old.tp_group is None else torch.distributed.get_world_size(old.tp_group)
        out_local, in_local = old.weight.shape
        new = te.Linear(
            in_local * (1 if column else tp_size), out_local * (tp_size if column else 1),
            bias=old.bias is not None, tp_group=old.tp_group, tp_size=tp_size,
            parallel_mode=old.parallel,
            sequence_parallel=old.sequence_parallel, params_dtype=old.weight.dtype,
            device=old.weight.device)
        new.weight.copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
            if getattr(old.bias, "sequence_parallel", False):
                new.bias.sequence_parallel = True
        new.tp_group, new.sequence_parallel = old.tp_group, old.sequence_parallel
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return len(swaps)
