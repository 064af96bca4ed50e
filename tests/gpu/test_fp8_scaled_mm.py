"""FP8 linears on CUDA: the `Fp8` weight format picks `torch._scaled_mm` on FP8 GPUs and agrees
with the dequantized product (skipped without CUDA; the `_scaled_mm` kernels need compute
capability 8.9+).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.fp8 import dequantize, to_fp8_
from tessera.core.parallel.layers import plain_linear


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_on_cuda_matches_dequantized(per_channel, dtype):
    dev = torch.device("cuda")
    need = (9, 0) if per_channel else (8, 9)
    if torch.cuda.get_device_capability(dev) < need:
        pytest.skip(f"FP8 _scaled_mm ({'rowwise' if per_channel else 'tensorwise'}) needs sm{need}")
    layer = torch.nn.Linear(256, 512, bias=True, device=dev, dtype=dtype)
    fp8 = to_fp8_(plain_linear(layer), per_channel)  # use_scaled_mm=None: decided per device
    x = torch.randn(4, 33, 256, device=dev, dtype=dtype)
    want = F.linear(x.float(), dequantize(fp8.weight, fp8.scale), layer.bias.float())
    got = fp8(x)
    assert got.dtype == dtype and got.shape == (4, 33, 512)
    assert ((got.float() - want).norm() / want.norm()).item() < 0.08
    fp8.format.use_scaled_mm = False  # the dequantizing fallback on the same device
    torch.testing.assert_close(fp8(x).float(), want, rtol=2e-2, atol=2e-2)
