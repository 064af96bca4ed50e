"""The Transformer Engine backend is optional: without CUDA + TE the plain backend is used."""

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.parallel.layers import ColumnParallelLinear
from tessera.core.te_backend import transformer_engine_available


def test_auto_backend_is_plain_pytorch_on_cpu():
    assert not transformer_engine_available("cpu")
    model = build_model(ModelConfig.from_name("llama-tiny"), backend="auto")
    assert isinstance(model.layers["0"].attention.wqkv, ColumnParallelLinear)


def test_te_backend_refused_clearly_where_it_cannot_run():
    with pytest.raises(RuntimeError, match="needs a CUDA device and transformer_engine"):
        build_model(ModelConfig.from_name("llama-tiny"), backend="te")
    with pytest.raises(ValueError, match="unknown backend"):
        build_model(ModelConfig.from_name("llama-tiny"), backend="apex")


@pytest.mark.skipif(not transformer_engine_available("cuda" if torch.cuda.is_available()
                                                      else "cpu"), reason="needs CUDA + TE")
def test_te_backend_matches_plain_backend_on_cuda():
    config = ModelConfig.from_name("llama-tiny")
    plain = build_model(config, device="cuda", backend="torch", seed=2)
    te = build_model(config, device="cuda", backend="te", seed=2)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in te.named_parameters()]
    ids = torch.randint(0, config.vocab_size, (2, 16), device="cuda")
    torch.testing.assert_close(te(ids), plain(ids), atol=1e-3, rtol=1e-3)
