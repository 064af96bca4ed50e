"""`tessera plan` for T5 (encoder-decoder): it proposes only what `tessera pretrain` runs for
T5 (no recomputation, one stage per rank, no cp, no fp8, pipeline sizes `t5_stage_split`
accepts) and refuses fixed flags that break those rules with the rule's own reason.
GPU profiles only: pure Python, no torch, no ranks."""

from __future__ import annotations

import pytest

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.t5_layout import t5_pipeline_sizes, t5_stage_split
from tessera.plan import Fixed, PlanError, TrainingJob, load_hardware, plan_training


def _job(preset: str = "t5-base", gpus: int = 8, **kw) -> TrainingJob:
    return TrainingJob(model=ModelConfig.from_name(preset), gpus=gpus,
                       hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=512, **kw)


def test_t5_candidates_are_what_pretrain_accepts():
    cands = plan_training(_job(gpus=24))
    assert cands
    pps = set()
    for c in cands:
        assert (c.recompute, c.virtual_stages, c.cp) == ("none", 1, 1)
        pps.add(c.pp)
    model = ModelConfig.from_name("t5-base")
    assert pps <= set(t5_pipeline_sizes(model))
    # dp divides the batch of 256, so tp x pp is 3 x a power of two (tp 1, 2, 4 or 8): pp 24 = 12 encoder + 12
    # decoder stages, which a decoder-only planner (pp dividing the 12 layers) never proposed.
    assert pps == {3, 6, 12, 24}


def test_t5_pipeline_sizes_follow_the_stage_split():
    # 12 encoder + 12 decoder layers: p stages split round(p/2) / p - round(p/2) (at least one
    # each), which must divide 12 each; e.g. 5 -> 2 + 3, 7 -> 4 + 3, 9 -> 4 + 5 (no).
    model = ModelConfig.from_name("t5-base")
    assert t5_pipeline_sizes(model) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 24]
    for p in range(1, 25):
        try:
            t5_stage_split(model, p)
            ok = True
        except ConfigError:
            ok = False
        assert ok == (p in t5_pipeline_sizes(model))


@pytest.mark.parametrize("fixed, says", [
    (Fixed(recompute="selective"), "recompute=selective: T5 trains without activation "
                                   "recomputation"),
    (Fixed(recompute="full"), "recompute=full: T5 trains without activation recomputation"),
    (Fixed(pp=2, virtual_stages=2), "virtual_stages=2: T5 runs one pipeline stage per rank"),
    (Fixed(cp=2), "cp=2: T5 runs without context parallelism"),
    (Fixed(pp=9), "cannot split over 4 encoder + 5 decoder stages evenly"),
])
def test_t5_fixed_flags_pretrain_refuses(fixed, says):
    with pytest.raises(PlanError) as err:
        plan_training(_job(gpus=72 if fixed.pp == 9 else 8), fixed)
    assert says in str(err.value)
    if fixed.pp != 9:  # 72 GPUs and batch 256 leave no valid pp at all
        assert "Valid here:" in str(err.value)


def test_t5_fp8_refused():
    job = TrainingJob(model=ModelConfig.from_name("t5-base"), gpus=8,
                      hardware=load_hardware("h100-80gb"), global_batch=256, seq_len=512,
                      precision="fp8")
    with pytest.raises(PlanError, match="T5 does not train in fp8"):
        plan_training(job)
