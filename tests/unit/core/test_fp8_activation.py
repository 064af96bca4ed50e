"""The activation quantizer of the FP8 linear: the compiled (fused) version equals the eager
formula bit for bit, and both equal `core.fp8.quantize` of the same tensor."""

from __future__ import annotations

import pytest
import torch

from tessera.core.fp8 import quantize
from tessera.core.fp8_activation import compiled_quantize_activation, quantize_activation_eager


def _activation(rows: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
    x[1] = 0.0  # an all-zero row takes scale 1
    x[2, 5] = 1e4  # one large value: the others of its row go subnormal
    return x.to(dtype)


@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "tensorwise"])
def test_fused_quantization_equals_unfused_bit_for_bit(rowwise):
    fused = compiled_quantize_activation()
    for rows, dtype in ((16, torch.bfloat16), (40, torch.bfloat16), (24, torch.float32)):
        x = _activation(rows, dtype)  # the second size runs the dynamic-shape recompile
        q, inv = quantize_activation_eager(x, rowwise)
        q_fused, inv_fused = fused(x, rowwise)
        q_ref, scale_ref = quantize(x, per_channel=rowwise)
        assert q.dtype == q_fused.dtype == torch.float8_e4m3fn
        assert inv.shape == inv_fused.shape == ((rows, 1) if rowwise else ())
        assert torch.equal(q.view(torch.uint8), q_fused.view(torch.uint8))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(inv, inv_fused) and torch.equal(inv, scale_ref.reciprocal())
