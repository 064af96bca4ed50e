"""No FP8 path synchronizes with the host on CUDA: the inference linear (tensorwise on 8.9+,
rowwise on 9.0+) and an emulated FP8 training step run under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any blocking copy or sync. Each
runs once before (that call may compile kernels, which is allowed to sync)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tessera.core import fused
from tessera.core.fp8 import to_fp8_
from tessera.core.fp8_recipe import Fp8Recipe
from tessera.core.fp8_training import enable_fp8_training
from tessera.core.parallel.layers import ColumnParallelLinear, plain_linear


@contextlib.contextmanager
def sync_is_an_error() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kernels", ["off", "on"])  # eager, or the compiled quantization
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_inference_linear_never_syncs(per_channel, kernels):
    dev = torch.device("cuda")
    need = (9, 0) if per_channel else (8, 9)
    if torch.cuda.get_device_capability(dev) < need:
        pytest.skip(f"FP8 _scaled_mm needs sm{need}")
    layer = to_fp8_(plain_linear(torch.nn.Linear(256, 512, device=dev, dtype=torch.bfloat16)),
                    per_channel)
    x = torch.randn(4, 64, 256, device=dev, dtype=torch.bfloat16)
    fused.set_mode(kernels)
    try:
        with torch.no_grad():
            layer(x)
            with sync_is_an_error():
                for _ in range(3):
                    y = layer(x)
    finally:
        fused.set_mode(None)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_emulated_fp8_training_step_never_syncs(recipe):
    layer = ColumnParallelLinear(256, 512, True, None).cuda()
    with torch.no_grad():  # the layer leaves its weights to the model's initializer
        layer.weight.normal_(0.0, 0.02)
        layer.bias.zero_()
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].attention = torch.nn.Module()
    holder.layers["0"].attention.wqkv = layer
    fp8 = enable_fp8_training([holder], Fp8Recipe("emulated", recipe, amax_history_len=4))
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)

    def step() -> None:
        layer(x).square().sum().backward()
        fp8.step_end()

    step()
    with sync_is_an_error():
        step()
        step()
    assert torch.isfinite(layer.weight.grad).all()
