"""A decoder family added as one folder and one registry line (`core/models/scalenorm/`) is built,
pretrained, checkpointed and reloaded by the generic code, with its own norm throughout."""

from __future__ import annotations

import pytest
import torch

from tessera.core.checkpoint import load_checkpoint, save_checkpoint
from tessera.core.config import ModelConfig
from tessera.core.init import build_model
from tessera.core.models.registry import family, registered
from tessera.core.models.scalenorm.norm import ScaleNorm
from tessera.core.parallel.sharding import global_param_shapes, local_shape
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint
from tests.pretrain_helper import pretrain_argv, read_losses


def tiny_scalenorm() -> ModelConfig:
    return ModelConfig.from_name("llama-tiny", family="scalenorm")


def test_registered_and_built_with_its_own_norm():
    assert "scalenorm" in registered() and family("scalenorm").name == "scalenorm"
    config = tiny_scalenorm()
    shapes = global_param_shapes(config)
    assert shapes["layers.0.attention_norm.scale"] == (1,) and shapes["norm.scale"] == (1,)
    assert not any(name.endswith("norm.weight") for name in shapes)  # no RMSNorm weights left
    assert local_shape("norm.scale", config, 2) == (1,)  # replicated over tp
    model = build_model(config, seed=3)
    norms = [m for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(norms) == 2 * config.num_layers + 1
    assert dict((n, tuple(p.shape)) for n, p in model.named_parameters()) == shapes
    assert all(float(m.scale.detach()) == 1.0 for m in norms)


def test_scalenorm_normalizes_each_vector_to_its_scaled_length():
    norm = ScaleNorm(tiny_scalenorm(), sequence_parallel=False)
    with torch.no_grad():
        norm.scale.fill_(0.5)
    x = torch.randn(3, 5, 64) * 7
    lengths = norm(x).norm(dim=-1)
    torch.testing.assert_close(lengths, torch.full_like(lengths, 0.5 * 64 ** 0.5))


def test_save_and_reload_through_the_generic_checkpoint(tmp_path):
    model = build_model(tiny_scalenorm(), seed=5)
    with torch.no_grad():
        model.norm.scale.fill_(1.25)
    save_checkpoint(tmp_path / "ckpt", model)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config.family == "scalenorm" and isinstance(loaded.norm, ScaleNorm)
    want = dict(model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, want[name]), name
    ids = torch.randint(0, 512, (2, 12))
    assert torch.equal(loaded(ids), model.eval()(ids))


@pytest.mark.usefixtures("one_thread")
def test_pretrains_and_its_checkpoint_reloads(tiny, tmp_path):
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, "--model-overrides", f"vocab_size={tiny.vocab_size}",
                         "num_layers=4", "family=scalenorm")
    cfg, _ = load_config(argv)
    summary = pretrain(cfg)
    losses = read_losses(run)
    assert summary["steps"] == 8 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[8] < losses[1]  # it learns
    model = load_checkpoint(latest_checkpoint(run))
    assert model.config.family == "scalenorm"
    scales = [float(m.scale.detach()) for m in model.modules() if isinstance(m, ScaleNorm)]
    assert len(scales) == 9 and any(s != 1.0 for s in scales)  # trained, saved, reloaded
