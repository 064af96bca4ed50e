"""Regional compilation: `torch.compile` each transformer block of a model, not the whole model.

A whole-model `torch.compile` traces every layer, so its cold compile time grows with depth
(minutes for a 16-layer model). Every layer of a stack is an instance of one block class with
the same code and, per layer, parameters of the same shapes; Dynamo lifts a compiled module's
parameters into graph inputs, so all those layers share one compiled graph and the cold compile
costs one block at any depth. The embedding, the final norm and the head stay eager (they run
once per step; the fused kernels of `core.fused` still compile the norm and the loss there).

Every stage of every family keeps its layers in `nn.ModuleDict`s (or lists) named `layers`:
the decoder families and BERT at `layers`, T5 at `encoder.layers` and `decoder.layers`.
`Module.compile()` works in place, so parameter names (checkpoint keys, optimizer state) do not
change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.core.compile_cache import key_compile_cache_by_isa

STACK_NAME = "layers"


def layer_stacks(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer stack of `model` (a `ModuleDict` / `ModuleList` named `layers`), by its
    qualified name; a stack inside a block of another stack is not one."""
    stacks: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != STACK_NAME:
            continue
        if not isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            continue
        if any(name.startswith(outer + ".") for outer in stacks):
            continue
        stacks[name] = module
    return stacks


def compile_blocks(model: nn.Module, **options: Any) -> list[str]:
    """Compile each block of every layer stack of `model` in place (`Module.compile(**options)`,
    e.g. `backend=`, `mode=`); return the qualified names of the blocks compiled. Everything
    outside the stacks stays eager. Raises ValueError when `model` has no layer stack (a stack
    may be empty: a pipeline stage can hold no layers of one of its stacks)."""
    stacks = layer_stacks(model)
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no layer stack (an nn.ModuleDict or "
                         f"nn.ModuleList named {STACK_NAME!r}) to compile block by block; "
                         "keep a model's repeated blocks in one, or run without --compile")
    key_compile_cache_by_isa()
    compiled = []
    for stack_name, stack in stacks.items():
        for name, block in stack.named_children():
            block.compile(**options)
            compiled.append(f"{stack_name}.{name}" if stack_name else name)
    return compiled
