"""`moe_aux_loss_pooling = "model"`: what it refuses (the HF parity of its value and gradient is
checked in tests/unit/converters/test_hf_moe.py, its multi-rank forms in
tests/distributed/test_moe_parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.init import build_model
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.groups import ParallelGroups
from tessera.training.moe_step import begin_moe_step


def _config(**overrides) -> ModelConfig:
    base = dict(hidden_size=32, num_heads=4, ffn_hidden_size=48, num_layers=2,
                moe_aux_loss_pooling="model")
    return ModelConfig.from_name("mixtral-tiny", **{**base, **overrides})


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))


def test_unknown_pooling_is_named():
    with pytest.raises(ConfigError, match="moe_aux_loss_pooling 'models' is unknown"):
        _config(moe_aux_loss_pooling="models")


def test_pipeline_stages_are_refused():
    """With pp > 1 the MoE layers sit on different stages: no stage sees the pooled counts."""
    stage = GPTModel(_config(), groups=ParallelGroups(pp_size=2), stage_id=0, num_stages=2)
    stage.train()
    with pytest.raises(ConfigError, match=r"pp=2 .*moe_aux_loss_pooling='layer'"):
        stage(_ids())


def test_pretraining_with_pp_is_refused_before_the_schedule_runs():
    """The training loop refuses it up front (a pipeline schedule would wrap the layer's
    error), only while training: tuning runs the frozen base in eval, without router loss."""
    stage = GPTModel(_config(), groups=ParallelGroups(pp_size=2), stage_id=0, num_stages=2)
    job = SimpleNamespace(stages=[stage.train()], groups=stage.groups, schedule=object(),
                          scaler=None)
    with pytest.raises(ConfigError, match=r"pp=2 .*moe_aux_loss_pooling to 'layer'"):
        begin_moe_step(job)
    stage.eval()
    begin_moe_step(job)


def test_every_moe_layer_must_run_in_the_forward():
    model = build_model(_config(), seed=0).train()
    h = torch.randn(8, 2, 32)
    with pytest.raises(RuntimeError, match="without the model's first MoE layer 0"):
        model.layers["1"].feed_forward(h)  # a later layer cannot start a pool
    out = model.layers["0"].feed_forward(h)  # the first starts one; layer 1 never joins it
    with pytest.raises(RuntimeError, match=r"MoE layers \[1\] did not run"):
        out.sum().backward()
