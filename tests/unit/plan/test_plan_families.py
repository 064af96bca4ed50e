"""The planner models families through its registry, keyed by the core family names: every
family built on the decoder's stage gets the decoder's model without a line of its own, and a
family it has no model for is refused with a message that says so, before any estimate."""

from __future__ import annotations

import pytest

from tessera.core.config import ModelConfig
from tessera.core.models import registry as core_registry
from tessera.plan import PlanError, TrainingJob, load_hardware, plan_serving, plan_training
from tessera.plan.models import registry
from tessera.plan.models.registry import plan_family, planned_families


def test_every_core_family_has_a_planner_model():
    assert set(planned_families()) == set(core_registry.registered())


def test_decoder_families_share_one_model_and_t5_has_its_own():
    llama, mixtral, t5 = (plan_family(ModelConfig.from_name(n))
                          for n in ("llama-tiny", "mixtral-tiny", "t5-tiny"))
    assert llama is mixtral and t5 is not llama
    # A family that only swaps the decoder's norm (core/models/scalenorm) needs no line here.
    assert plan_family(ModelConfig.from_name("llama-tiny", family="scalenorm")) is llama
    assert t5.launch_flags == " --tokenizer TOKENIZER" and llama.launch_flags == ""


def test_a_family_without_a_planner_model_is_refused_by_name(monkeypatch):
    monkeypatch.delitem(registry._FAMILIES, "bert")
    model = ModelConfig.from_name("bert-base")
    job = TrainingJob(model=model, gpus=8, hardware=load_hardware("a100-80gb"),
                      global_batch=64, seq_len=128)
    with pytest.raises(PlanError, match="tessera plan does not model the bert family"):
        plan_training(job)
    with pytest.raises(PlanError, match="it plans: gpt2, llama, .*t5"):
        plan_serving(model, gpus=1, hardware=load_hardware("a100-80gb"))
