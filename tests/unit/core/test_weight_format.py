"""One parallel linear, weight formats as strategies, and the one `quantizable` rule that FP8,
int8 and Transformer Engine all follow (TE checked with a stand-in module: the real one needs
CUDA)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from tessera.core import ModelConfig, build_model
from tessera.core.fp8 import Fp8, convert_to_fp8_linear, to_fp8_
from tessera.core.parallel.layers import (
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    plain_linear,
    quantizable_linears,
)
from tessera.core.parallel.sharding import global_param_shapes
from tessera.core.parallel.weight_format import Dense, quantizable
from tessera.core.quantize import Int8, quantize
from tessera.core.te_backend import apply_transformer_engine

PRESETS = ["llama-tiny", "gpt2-tiny", "nemotron-tiny"]
BLOCK_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2")


def _block_linears(config: ModelConfig) -> list[str]:
    return [f"layers.{i}.{m}" for i in range(config.num_layers) for m in BLOCK_LINEARS]


@pytest.mark.parametrize("name", PRESETS)
def test_quantizable_names_the_four_block_linears_and_nothing_else(name):
    config = ModelConfig.from_name(name)
    names = [n for n in global_param_shapes(config) if quantizable(n)]
    assert names == [f"{m}.weight" for m in _block_linears(config)]
    assert quantizable("module.layers.3.feed_forward.w1.weight")  # a wrapper's prefix
    assert not quantizable("layers.3.feed_forward.w1.bias")
    assert not quantizable("xlayers.3.feed_forward.w1.weight")


def _fake_transformer_engine(monkeypatch):
    """A `transformer_engine.pytorch` whose `Linear` holds the parameters TE's would."""

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                     sequence_parallel, params_dtype, device):
            super().__init__()
            rows = out_features // tp_size if parallel_mode == "column" else out_features
            cols = in_features if parallel_mode == "column" else in_features // tp_size
            self.parallel_mode = parallel_mode
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.empty(rows, dtype=params_dtype)) if bias else None

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.Linear = Linear
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    return Linear


@pytest.mark.parametrize("name", PRESETS)
def test_fp8_int8_and_transformer_engine_convert_the_same_layers(name, monkeypatch):
    config = ModelConfig.from_name(name)
    expected = _block_linears(config)
    assert [n for n, _ in quantizable_linears(build_model(config))] == expected

    fp8 = convert_to_fp8_linear(build_model(config, seed=1))
    int8 = quantize(build_model(config, seed=1, dtype=torch.bfloat16), "int8")
    for model, fmt, dtype in ((fp8, Fp8, torch.float8_e4m3fn), (int8, Int8, torch.int8)):
        converted = [n for n, m in model.named_modules()
                     if isinstance(m, ParallelLinear) and isinstance(m.format, fmt)]
        assert converted == expected
        # Tensors keep their names in every format: `weight` (now `dtype`) and `scale`.
        state = model.state_dict()
        for n in expected:
            assert state[f"{n}.weight"].dtype == dtype and f"{n}.scale" in state
        if model.output is not None:
            assert isinstance(model.output.format, Dense)

    linear = _fake_transformer_engine(monkeypatch)
    plain = build_model(config, seed=1)
    te = build_model(config, seed=1)
    assert apply_transformer_engine(te) == len(expected)
    assert [n for n, m in te.named_modules() if isinstance(m, linear)] == expected
    assert te.output is None or isinstance(te.output, ColumnParallelLinear)
    plain_params = dict(plain.named_parameters())
    for n, p in te.named_parameters():  # same names, shapes and values
        assert torch.equal(p, plain_params.pop(n)), n
    assert not plain_params


def test_quantized_formats_refuse_what_they_cannot_take(monkeypatch):
    with pytest.raises(ValueError, match="'column' or 'row'"):
        ParallelLinear(4, 4, False, "diagonal", None)
    layer = to_fp8_(plain_linear(nn.Linear(32, 16)))
    assert isinstance(layer.format, Fp8) and not layer.bias.requires_grad
    with pytest.raises(ValueError, match="dense weight"):
        to_fp8_(layer)
    with pytest.raises(ValueError, match=r"shape \(8, 32\) cannot replace one of shape \(16, 32\)"):
        plain_linear(nn.Linear(32, 16)).set_format(Int8(), torch.zeros(8, 32, dtype=torch.int8))
    _fake_transformer_engine(monkeypatch)
    model = convert_to_fp8_linear(build_model(ModelConfig.from_name("llama-tiny")))
    with pytest.raises(ValueError, match="Transformer Engine takes dense ones"):
        apply_transformer_engine(model)


def test_one_forward_for_every_format_and_both_splits():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 32)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(32, 48, True, None)
        nn.init.normal_(layer.weight)
        nn.init.normal_(layer.bias)
        dense = layer(x)
        torch.testing.assert_close(dense, nn.functional.linear(x, layer.weight, layer.bias))
        b = layer.bias
        to_fp8_(layer, per_channel=True, use_scaled_mm=False)
        want = nn.functional.linear(x, layer.weight.float() / layer.scale, b)
        assert torch.equal(layer(x), want)
        assert ((layer(x) - dense).norm() / dense.norm()) < 0.05
        assert "format=Fp8(use_scaled_mm=False)" in repr(layer)
