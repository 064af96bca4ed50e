"""`quantize(model, "fp8")` for serving: per-channel e4m3 weights, and the logit error it
causes, measured as `tessera serve --quantize fp8` reports it at start.

The bound. e4m3 keeps 3 mantissa bits, so rounding to it moves a value by at most half a step,
2**-4 of the value at the bottom of its binade; a uniform rounding error has an RMS of that over
sqrt(3), 0.036. A product of n terms whose operands carry independent errors has about the same
relative RMS error as one operand (the errors add in quadrature like the terms do): 0.036 with
FP8 weights (the dequantizing product, W8A16), sqrt(2) x 0.036 = 0.051 with FP8 activations too
(`torch._scaled_mm`, W8A8). The logits of these 2-layer models mix the outputs of 8 quantized
linears with an unquantized embedding and output layer; if each linear carried the whole signal
their independent errors would add to sqrt(8) x 0.051 = 0.144 at most. The bound, 2**-3 =
0.125 (W8A8) and 0.1 (W8A16, sqrt(8) x 0.036), is that estimate; a broken scale (unscaled cast
of 0.02-sized weights, a scale on the wrong axis, a missing dequantization) is off by the size
of the logits, relative error ~1.
"""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.fp8 import Fp8
from tessera.core.parallel.layers import quantizable_linears
from tessera.core.quantize import quantize
from tessera.core.quantize_error import logit_error, probe_ids, quantize_measured

BOUND = {"W8A16": 0.1, "W8A8": 2.0 ** -3}


def _model(name: str) -> torch.nn.Module:
    return build_model(ModelConfig.from_name(name, init_std=0.02), seed=0).eval()


def test_fp8_quantizes_every_block_linear_per_output_channel():
    model = _model("llama-tiny")
    dense = {name: layer.weight.detach().clone() for name, layer in quantizable_linears(model)}
    quantize(model, "fp8")
    for name, layer in quantizable_linears(model):
        assert isinstance(layer.format, Fp8), name
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.scale.shape == (layer.weight.shape[0], 1)  # vLLM's channel scales (out, 1)
        w = dense[name]
        # Each row's largest |w| maps to 448 exactly: the scale is that row's own.
        torch.testing.assert_close(layer.scale, 448.0 / w.abs().amax(dim=1, keepdim=True))
        assert (layer.weight.float().abs().amax(dim=1) == 448).all()


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "nemotron-tiny"])
@pytest.mark.parametrize("product", ["W8A16", "W8A8"])
def test_fp8_logit_error_is_within_the_e4m3_bound(name, product):
    model = _model(name)
    ids = probe_ids(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids)
        quantize(model, "fp8")
        if product == "W8A8":  # the Hopper product, through torch's CPU _scaled_mm
            for _, layer in quantizable_linears(model):
                layer.format = Fp8(use_scaled_mm=True)
        error = logit_error(reference, model(ids), "fp8")
    print(f"\n{name} {product}: {error.describe()}")
    assert 0 < error.relative_rms < BOUND[product]
    assert error.top1_agreement >= 0.9  # the sampled token rarely changes


def test_quantize_measured_reports_what_serving_prints():
    model = _model("llama-tiny")
    error = quantize_measured(model, "fp8")
    assert error is not None and error.tokens == 64 and error.method == "fp8"
    assert 0 < error.relative_rms < BOUND["W8A16"]
    assert all(isinstance(m.format, Fp8) for _, m in quantizable_linears(model))
    assert error.describe().startswith("fp8 weights (W8A16: FP8 weights dequantized per product")
    assert "logit error vs the unquantized model " in error.describe()
    assert quantize_measured(_model("llama-tiny"), "none") is None


def test_probe_is_the_same_everywhere():
    assert torch.equal(probe_ids(512), probe_ids(512))
    assert probe_ids(512).shape == (1, 64) and int(probe_ids(7).max()) < 7


def test_fp8_model_quantized_under_inference_mode_runs():
    """A model loaded and quantized under `torch.inference_mode` (as a bench or a notebook
    does) holds inference tensors, which have no version counter to key a cache on."""
    model = _model("llama-tiny")
    ids = probe_ids(model.config.vocab_size)
    with torch.inference_mode():
        reference = model(ids)
        quantize(model, "fp8")
        for _, layer in quantizable_linears(model):
            layer.format = Fp8(use_scaled_mm=True)
        error = logit_error(reference, model(ids), "fp8")
    assert 0 < error.relative_rms < BOUND["W8A8"]
