"""FP8 training, emulated: quantization against torch's float8 dtypes and `torch._scaled_mm`,
the layer's forward and backward against fake-quantized references, delayed scaling's amax
history, the layers chosen, and the recipe resolution's clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core import ModelConfig, build_model
from tessera.core.config import ConfigError
from tessera.core.fp8_recipe import Fp8Recipe, resolve_fp8_recipe, torchao_available
from tessera.core.fp8_training import (
    GRAD,
    INPUT,
    WEIGHT,
    EmulatedFp8,
    Fp8Training,
    enable_fp8_training,
    fake_quantize,
    fp8_matmul,
    fp8_max,
    quantize_fp8,
    scale_from_amax,
)
from tessera.core.parallel.layers import ColumnParallelLinear
from tessera.core.parallel.weight_format import DENSE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_fp8_maxima_and_saturation_follow_torchs_float8_dtypes():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    one = torch.tensor(1.0)
    x = torch.tensor([0.1, -1.0, 3.3, 300.0, 448.0, 449.0, 1000.0, -1e6, float("inf")])
    q = quantize_fp8(x, one, E4M3)
    assert q.dtype == E4M3
    assert q.float()[-4:].tolist() == [448.0, 448.0, -448.0, 448.0]  # saturates
    assert torch.equal(q.float()[:5], x[:5].to(E4M3).float())  # in range: torch's own rounding
    y = torch.tensor([1e-3, 5.0, 57344.0, 60000.0, 1e9, -float("inf")])
    q5 = quantize_fp8(y, one, E5M2)
    assert q5.float()[2:].tolist() == [57344.0, 57344.0, 57344.0, -57344.0]
    assert torch.isinf(y[4].to(E5M2).float())  # torch's plain cast overflows: we clamp
    assert torch.equal(q5.float()[:3], y[:3].to(E5M2).float())


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [(E4M3, 3), (E5M2, 2)])
def test_fake_quantize_error_is_half_an_ulp_of_the_format(dtype, mantissa_bits):
    x = torch.randn(4096) * 3
    scale = scale_from_amax(x.abs().amax(), dtype)
    assert torch.allclose(scale, fp8_max(dtype) / x.abs().amax())
    deq = fake_quantize(x, scale, dtype)
    normal = (x.abs() * scale) >= torch.finfo(dtype).tiny  # subnormals round absolutely
    rel = ((deq - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-7
    assert rel.mean() > 2.0 ** -(mantissa_bits + 4)  # it really rounds


def test_scale_from_amax_keeps_the_previous_scale_for_zero_or_non_finite_amax():
    previous = torch.tensor([2.0, 3.0, 4.0, 5.0])
    amax = torch.tensor([0.0, float("inf"), float("nan"), 4.0])
    got = scale_from_amax(amax, E4M3, margin=1, previous=previous)
    assert got.tolist() == [2.0, 3.0, 4.0, 448.0 / 4.0 / 2.0]


def test_fp8_matmul_equals_torch_scaled_mm_on_cpu():
    a, b = torch.randn(32, 48), torch.randn(16, 48)
    sa = scale_from_amax(a.abs().amax(), E4M3)
    sb = scale_from_amax(b.abs().amax(), E4M3)
    qa, qb = quantize_fp8(a, sa, E4M3), quantize_fp8(b, sb, E4M3)
    ref = torch._scaled_mm(qa, qb.t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                           out_dtype=torch.float32)
    torch.testing.assert_close(fp8_matmul(qa, sa, qb.t(), sb), ref, rtol=1e-5, atol=1e-5)


def _layer(recipe: Fp8Recipe) -> tuple[ColumnParallelLinear, Fp8Training]:
    """A 48 -> 32 linear with a bias, named as a block's QKV so FP8 takes it."""
    layer = ColumnParallelLinear(48, 32, True, None)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias, std=0.1)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].attention = torch.nn.Module()
    holder.layers["0"].attention.wqkv = layer
    fp8 = enable_fp8_training([holder], recipe)
    assert list(fp8.layers) == ["layers.0.attention.wqkv"]
    return layer, fp8


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_emulated_linear_forward_and_backward_match_fake_quantized_products(fmt):
    """Current scaling: y = fq(x) fq(W)^T + b; dx = fq(g) fq(W); dW = fq(g)^T fq(x), with the
    gradient in e5m2 (hybrid) or e4m3."""
    layer, _ = _layer(Fp8Recipe("emulated", "tensorwise", fmt))
    assert isinstance(layer.format, EmulatedFp8)
    x = torch.randn(2, 5, 48, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    xq, wq = (fake_quantize(t, scale_from_amax(t.abs().amax(), E4M3), E4M3)
              for t in (x.detach(), layer.weight.detach()))
    gdt = E5M2 if fmt == "hybrid" else E4M3
    gq = fake_quantize(g, scale_from_amax(g.abs().amax(), gdt), gdt)
    torch.testing.assert_close(y, F.linear(xq, wq, layer.bias), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(layer.weight.grad, gq.reshape(-1, 32).t() @ xq.reshape(-1, 48),
                               rtol=1e-5, atol=1e-9)
    # and it is not the unquantized product
    assert (y - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-4


def test_delayed_scaling_uses_the_amax_history_of_earlier_steps():
    """TE's DelayedScaling: step 1 runs at scale 1; each step's amaxes (input, weight, output
    gradient) enter the history; the next scales are fp8_max / max(history) / 2**margin; the
    window keeps `amax_history_len` steps; evaluation forwards record nothing."""
    recipe = Fp8Recipe("emulated", "delayed", "hybrid", amax_history_len=2, margin=1)
    layer, fp8 = _layer(recipe)
    seen = []  # per step: the amaxes of input, weight and output gradient
    for step, size in enumerate([4.0, 1.0, 0.5]):
        scales = layer.fp8_scale.clone()
        x = torch.randn(3, 48)
        x = x / x.abs().amax() * size
        (layer(x).sum() * 1e-3).backward()  # every output gradient is 1e-3
        with torch.no_grad():
            layer(x * 100)  # evaluation: must not enter the history
        amaxes = [0.0] * 3
        amaxes[INPUT], amaxes[WEIGHT], amaxes[GRAD] = size, layer.weight.abs().amax().item(), 1e-3
        seen.append(amaxes)
        fp8.step_end()
        if step == 0:
            assert scales.tolist() == [1.0, 1.0, 1.0]
        window = torch.tensor(seen[-2:]).amax(dim=0)
        top = torch.tensor([448.0, 448.0, 57344.0])
        torch.testing.assert_close(layer.fp8_scale, top / window / 2, rtol=1e-6, atol=0)
        layer.weight.grad = None
    assert layer.fp8_scale[INPUT] == 448.0 / 1.0 / 2  # the 4.0 of step 1 left the window
    assert layer.fp8_amax_history[0].tolist() == [0.0, 0.0, 0.0]
    assert layer.fp8_scale[WEIGHT] > 1


def test_block_linears_only_and_non_multiples_of_16_stay_bf16():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=1)  # ffn 172: MLP is not x16
    fp8 = enable_fp8_training([model], resolve_fp8_recipe("cpu"))
    assert sorted(fp8.layers) == [f"layers.{i}.attention.{n}" for i in (0, 1) for n in ("wo", "wqkv")]
    assert [n for n, _ in fp8.fallback] == [f"layers.{i}.feed_forward.{n}" for i in (0, 1)
                                            for n in ("w1", "w2")]
    assert "layers.0.feed_forward.w1 344x64" in fp8.describe()
    assert model.layers["0"].feed_forward.w1.format is DENSE
    assert model.output.weight is not None and not hasattr(model.output, "fp8_scale")
    with pytest.raises(ConfigError, match="multiples of 16.*layers.0.feed_forward.w1 344x64"):
        enable_fp8_training([build_model(ModelConfig.from_name("llama-tiny"))],
                            Fp8Recipe("te", "delayed"))


def test_recipe_resolution_and_clear_errors(monkeypatch):
    r = resolve_fp8_recipe("cpu")
    assert (r.backend, r.recipe, r.fp8_format, r.amax_history_len) == ("emulated", "delayed",
                                                                        "hybrid", 1024)
    assert resolve_fp8_recipe("cpu", recipe="current").recipe == "tensorwise"
    assert Fp8Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ConfigError, match=r"needs a CUDA device and Transformer Engine.*tessera\[te\]"):
        resolve_fp8_recipe("cpu", "te")
    monkeypatch.setattr("tessera.core.fp8_recipe.torchao_available", lambda: False)
    with pytest.raises(ConfigError, match=r'torchao needs torchao: pip install "tessera\[fp8\]"'):
        resolve_fp8_recipe("cpu", "torchao")
    assert resolve_fp8_recipe("cpu", recipe="rowwise") == Fp8Recipe("emulated", "rowwise", "e4m3")
    with pytest.raises(ConfigError, match="'block' needs a CUDA device"):
        resolve_fp8_recipe("cpu", recipe="block")
    offers = ("te: delayed, tensorwise, block, mxfp8; torchao: tensorwise, rowwise, "
              "rowwise-gw-hp; emulated: delayed, tensorwise, rowwise")
    with pytest.raises(ConfigError, match="fp8 backend emulated offers the recipes delayed, "
                                          f"tensorwise, rowwise, not 'mxfp8' \\(by backend: {offers}\\)"):
        resolve_fp8_recipe("cpu", "emulated", "mxfp8")
    with pytest.raises(ConfigError, match="(?s)unknown fp8 format .e5m2.*history length must be >= 1"):
        resolve_fp8_recipe("cpu", amax_history_len=0, fp8_format="e5m2")


@pytest.mark.skipif(not torchao_available(), reason='torchao not installed (tessera[fp8])')
def test_torchao_emulate_agrees_with_our_tensorwise_emulation():
    """torchao's own float8 training (emulate=True on CPU) on a ParallelLinear gives what our
    tensorwise emulation gives: the same quantization, products in different precision."""
    torch.manual_seed(0)
    ours, _ = _layer(Fp8Recipe("emulated", "tensorwise"))
    theirs, _ = _layer(resolve_fp8_recipe("cpu", "torchao", "tensorwise"))
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias)
    x = torch.randn(4, 48)
    ya, yb = ours(x), theirs(x)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs.weight.grad, ours.weight.grad, rtol=1e-3, atol=1e-3)


def _pow2_rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """torchao's rowwise scale: 448 / amax along `dim`, rounded down to a power of two."""
    scale = 448.0 / t.abs().amax(dim=dim, keepdim=True)
    return torch.exp2(torch.floor(torch.log2(scale)))


def test_rowwise_scales_each_product_along_its_summed_dimension():
    """y = fq(x, rows) fq(W, out channels)^T; dx = fq(g, rows) fq(W, in features);
    dW = fq(g, out features)^T fq(x, in features): e4m3 throughout, power-of-two scales."""
    layer, _ = _layer(Fp8Recipe("emulated", "rowwise", "e4m3"))
    x = torch.randn(2, 5, 48, requires_grad=True)
    x.data[0, 0] *= 1e6  # one loud token: under a tensor scale the others fall to subnormals
    y = layer(x)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    x2, w, g2 = x.detach().reshape(-1, 48), layer.weight.detach(), g.reshape(-1, 32)

    def fq(t, dim):
        return fake_quantize(t, _pow2_rowwise(t, dim), E4M3)

    torch.testing.assert_close(y.reshape(-1, 32), fq(x2, -1) @ fq(w, -1).t() + layer.bias,
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.reshape(-1, 48), fq(g2, -1) @ fq(w, 0), rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.weight.grad, fq(g2, 0).t() @ fq(x2, 0), rtol=1e-6, atol=0)
    # per-row scales keep the quiet rows' precision: a tensor scale would not
    quiet = (y - F.linear(x, layer.weight, layer.bias)).detach()[1].abs().max()
    tensorwise, _ = _layer(Fp8Recipe("emulated", "tensorwise", "e4m3"))
    with torch.no_grad():
        tensorwise.weight.copy_(layer.weight)
        tensorwise.bias.copy_(layer.bias)
        loud = (tensorwise(x) - F.linear(x, layer.weight, layer.bias))[1].abs().max()
    assert 0 < quiet < loud / 4


@pytest.mark.skipif(not torchao_available(), reason='torchao not installed (tessera[fp8])')
def test_torchao_emulate_equals_our_rowwise_emulation_bit_for_bit():
    """torchao's rowwise recipe (emulate=True on CPU) and ours: the same power-of-two scales
    make dequantizing exact, so both products are the same fp32 sums."""
    torch.manual_seed(0)
    ours, _ = _layer(resolve_fp8_recipe("cpu", "emulated", "rowwise"))
    theirs, _ = _layer(resolve_fp8_recipe("cpu", "torchao", "rowwise"))
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias)
    x = torch.randn(4, 48)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_fast_accumulation_in_forward_products_only(recipe, monkeypatch):
    """Hopper's fast FP8 accumulation (`use_fast_accum`) where the recipes permit it, as TE
    and torchao do: the forward product; the gradients accumulate in full precision."""
    import tessera.core.fp8_training as fp8_training

    calls = []
    matmul = fp8_training.fp8_matmul

    def recording(*args, fast_accum=False):
        calls.append(fast_accum)
        return matmul(*args, fast_accum=fast_accum)

    monkeypatch.setattr(fp8_training, "fp8_matmul", recording)
    layer, _ = _layer(resolve_fp8_recipe("cpu", "emulated", recipe))
    x = torch.randn(4, 48, requires_grad=True)
    y = layer(x)
    assert calls == [True]
    y.sum().backward()
    assert calls == [True, False, False]


def test_fp8_inference_products_use_fast_accumulation(monkeypatch):
    from tessera.core.fp8 import to_fp8_
    from tessera.core.parallel.layers import plain_linear

    seen = []
    scaled_mm = torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs["use_fast_accum"])
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    layer = to_fp8_(plain_linear(torch.nn.Linear(64, 32)), True, use_scaled_mm=True)
    with torch.no_grad():
        layer(torch.randn(3, 64))
    assert seen == [True]
