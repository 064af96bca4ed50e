"""Weight-only int8: torch's int8 kernel against the dequantized product, and what quantizing
a model costs in accuracy."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.quantize import Int8Weight, quantize


@pytest.mark.parametrize("rows, in_features, out_features", [
    (1, 512, 3072),   # a decode step: the kernel path
    (33, 64, 100),    # more rows than KERNEL_MAX_ROWS: dequantized
    (4, 64, 100),
    (5, 172, 64),     # in_features % 16 != 0: the dequantized path (the kernel misreads it)
    (7, 200, 48),
])
def test_int8_product_equals_the_dequantized_matmul(rows, in_features, out_features):
    weight = torch.randn(out_features, in_features)
    w8 = Int8Weight(weight)
    assert w8.qweight.dtype == torch.int8 and w8.qweight.abs().max() <= 127
    # Quantization error of the weight itself: at most half a step per element.
    step = w8.scale.float()[:, None]
    assert ((w8.dequantize() - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    reference = x.float() @ w8.dequantize().t()
    out = w8.linear(x)
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
    int8 = [m for m in model.modules() if isinstance(m, Int8Weight)]
    # wqkv, wo, w1, w2 per layer, plus the output layer when untied
    assert len(int8) == 4 * config.num_layers + (0 if config.tied_embeddings else 1)
    assert ((out - reference).norm() / reference.norm()) < 0.02
    assert (out.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_unknown_method_is_refused():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    with pytest.raises(ValueError, match="unknown quantization 'int4'.*int8"):
        quantize(model, "int4")
    assert quantize(model, "none") is model
