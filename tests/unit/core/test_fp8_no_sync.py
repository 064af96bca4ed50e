"""No FP8 path waits for the device: counted on CPU under a dispatch mode.

A host sync shows on CPU as the op that causes it: reading a value back
(`_local_scalar_dense`, `item`, `is_nonzero`) or building a tensor from Python data
(`lift_fresh`, which on CUDA is a blocking host-to-device copy). The CUDA side of the same
contract is tests/gpu/test_fp8_no_sync.py, under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.core.fp8 import scale_from_amax, to_fp8_
from tessera.core.fp8_recipe import Fp8Recipe
from tessera.core.fp8_training import enable_fp8_training
from tessera.core.parallel.layers import ColumnParallelLinear, plain_linear

SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.lift_fresh",
            "aten.lift_fresh_copy"}


class SyncCounter(TorchDispatchMode):
    """Counts the ops in `SYNC_OPS` (by packet name) dispatched inside the context."""

    def __init__(self):
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten.{func._schema.name.split('::')[-1]}"
        if name in SYNC_OPS:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_a_sync():
    with SyncCounter() as counter:
        torch.as_tensor(448.0)
        torch.ones(2).sum().item()
    assert counter.seen == {"aten.lift_fresh": 1, "aten._local_scalar_dense": 1}


def test_scale_from_amax_builds_no_tensor_from_host_data():
    amax, maxima = torch.tensor([0.0, 3.0]), torch.tensor([448.0, 57344.0])
    with SyncCounter() as counter:
        scale = scale_from_amax(amax, torch.float8_e4m3fn, margin=1)
        scale_from_amax(amax, maxima, previous=scale)
    assert not counter.seen


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_inference_linear_has_no_sync(per_channel):
    layer = to_fp8_(plain_linear(torch.nn.Linear(64, 32)), per_channel, use_scaled_mm=True)
    x = torch.randn(3, 5, 64)
    with torch.no_grad(), SyncCounter() as counter:
        for _ in range(3):
            layer(x)
    assert not counter.seen


def _holder(layer: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].attention = torch.nn.Module()
    holder.layers["0"].attention.wqkv = layer
    return holder


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_emulated_fp8_training_step_has_no_sync(recipe):
    layer = ColumnParallelLinear(48, 32, True, None)
    fp8 = enable_fp8_training([_holder(layer)], Fp8Recipe("emulated", recipe, amax_history_len=4))
    x = torch.randn(2, 5, 48, requires_grad=True)
    with SyncCounter() as counter:
        for _ in range(2):
            layer(x).square().sum().backward()
            fp8.step_end()
    assert not counter.seen
