"""FP8 training's products on CUDA are `torch._scaled_mm` on FP8 tensor cores (8.9+) and agree
with the fp32 formula the CPU runs, for every operand pairing the training step uses."""

from __future__ import annotations

import pytest
import torch

from tessera.core.fp8 import scale_from_amax
from tessera.core.fp8_training import fp8_gemm_fits, fp8_matmul, quantize_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_matmul_on_cuda_is_scaled_mm_and_matches_fp32(a_dtype, b_dtype, fast_accum):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm89+")
    a, b = torch.randn(128, 256, device="cuda"), torch.randn(256, 64, device="cuda") * 0.02
    sa, sb = scale_from_amax(a.abs().amax(), a_dtype), scale_from_amax(b.abs().amax(), b_dtype)
    qa, qb = quantize_fp8(a, sa, a_dtype), quantize_fp8(b, sb, b_dtype)
    assert fp8_gemm_fits(qa, qb)
    got = fp8_matmul(qa, sa, qb, sb, fast_accum=fast_accum)
    want = (qa.float() @ qb.float()) / (sa * sb)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert not fp8_gemm_fits(qa.to(torch.float32).to(E5M2), qb.float().to(E5M2))


@pytest.mark.parametrize("fast_accum", [False, True])
def test_rowwise_fp8_matmul_on_hopper_is_scaled_mm_and_matches_fp32(fast_accum):
    """Row scales `(M, 1)` and `(1, N)`, e4m3 both (the rowwise recipe): the kernel returns
    bf16, so the bound is bf16's half step, 2**-9 relative, on top of the fp32 sum."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-scaled FP8 _scaled_mm needs sm90+")
    a, b = torch.randn(128, 256, device="cuda"), torch.randn(256, 64, device="cuda") * 0.02
    sa = scale_from_amax(a.abs().amax(dim=1, keepdim=True), E4M3)
    sb = scale_from_amax(b.abs().amax(dim=0, keepdim=True), E4M3)
    qa, qb = quantize_fp8(a, sa, E4M3), quantize_fp8(b, sb, E4M3)
    assert fp8_gemm_fits(qa, qb, rowwise=True)
    got = fp8_matmul(qa, sa, qb, sb, fast_accum=fast_accum)
    want = (qa.float() @ qb.float()) / (sa * sb)
    torch.testing.assert_close(got, want, rtol=2.0 ** -8, atol=1e-3 * want.abs().max().item())
