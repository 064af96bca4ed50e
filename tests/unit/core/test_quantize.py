"""Weight-only int8: torch's int8 kernel against the dequantized product, and what quantizing
a model costs in accuracy."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.quantize import Int8, dequantize_int8, int8_linear, quantize, quantize_int8


@pytest.mark.parametrize("rows, in_features, out_features", [
    (1, 512, 3072),   # a decode step: the kernel path
    (33, 64, 100),    # more rows than KERNEL_MAX_ROWS: dequantized
    (4, 64, 100),
    (5, 172, 64),     # in_features % 16 != 0: the dequantized path (the kernel misreads it)
    (7, 200, 48),
])
def test_int8_product_equals_the_dequantized_matmul(rows, in_features, out_features):
    weight = torch.randn(out_features, in_features)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    # Quantization error of the weight itself: at most half a step per element.
    step = scale.float()[:, None]
    assert ((dequantize_int8(q, scale) - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    reference = x.float() @ dequantize_int8(q, scale).t()
    out = int8_linear(x, q, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max())


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "nemotron-tiny"])
def test_quantized_model_stays_close_to_bf16(name):
    config = ModelConfig.from_name(name, init_std=0.02)
    model = build_model(config, seed=0, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        reference = model(ids).float()
        quantize(model, "int8")
        out = model(ids).float()
    int8 = [n for n, m in model.named_modules() if isinstance(getattr(m, "format", None), Int8)]
    # wqkv, wo, w1, w2 per layer (weight_format.quantizable): the output layer stays bf16
    assert int8 == [f"layers.{i}.{m}" for i in range(config.num_layers) for m in
                    ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2")]
    assert all(m.weight.dtype == torch.int8 for m in model.modules()
               if isinstance(getattr(m, "format", None), Int8))
    if model.output is not None:
        assert model.output.weight.dtype == torch.bfloat16
    assert ((out - reference).norm() / reference.norm()) < 0.02
    assert (out.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_unknown_method_is_refused():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    with pytest.raises(ValueError, match="unknown quantization 'int4'.*int8"):
        quantize(model, "int4")
    assert quantize(model, "none") is model
