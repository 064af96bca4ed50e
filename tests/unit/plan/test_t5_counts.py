"""The planner's T5 counts against references nobody here wrote: the parameter count equals
`sum(p.numel())` of Hugging Face's `T5ForConditionalGeneration` built from the preset's config
(on the meta device: nothing allocated, nothing downloaded), and the FLOPs per step equal
PyTorch's `FlopCounterMode` over a tiny HF T5's forward and backward, and hand arithmetic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tessera.converters.hf_mapping import config_to_hf  # noqa: E402
from tessera.core.config import ModelConfig  # noqa: E402
from tessera.plan.models.t5.formulas import (  # noqa: E402
    t5_decoder_length,
    t5_flops_per_step,
    t5_parameter_counts,
    t5_stage_parameters,
)


def _hf(model: ModelConfig, device: str = "meta"):
    config = transformers.T5Config(**config_to_hf(model))
    # Eager attention: explicit matmuls FlopCounterMode counts (CPU SDPA kernels it does not).
    config._attn_implementation = "eager"
    with torch.device(device):
        hf = transformers.T5ForConditionalGeneration(config)
        if not model.tied_embeddings:
            # transformers 5 always ties lm_head to the embedding at init (T5Config forces
            # tie_word_embeddings=True and reads False as "do not scale"); a v1.1 checkpoint
            # loads its own lm_head, so give it one, as test_hf_t5.py does.
            hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.shared.weight))
    return hf


ORIGINAL = dict(activation="relu", tied_embeddings=True, options=dict(scaled_output=True))


@pytest.mark.parametrize("preset, overrides", [
    ("t5-base", {}), ("t5-tiny", {}),
    ("t5-base", ORIGINAL),  # the original T5: ReLU MLP, tied output (HF's own tying, as is)
    ("t5-tiny", dict(options=dict(num_decoder_layers=3, relative_attention_num_buckets=8))),
])
def test_t5_parameters_equal_hf(preset, overrides):
    model = ModelConfig.from_name(preset, **overrides)
    hf = _hf(model)
    counted = t5_parameter_counts(model).total
    assert counted == sum(p.numel() for p in hf.parameters())
    # Pipeline stages hold every parameter once, plus a copy of the embedding on the first
    # decoder stage (and, tied, on the last): pp 1 is exactly the model.
    assert sum(t5_stage_parameters(model, 1)) == counted
    if preset == "t5-base" and not overrides:
        # T5 v1.1 base as released (google/t5-v1_1-base): 247,577,856 parameters.
        assert counted == 247_577_856
        extra = model.vocab_size * model.hidden_size
        assert sum(t5_stage_parameters(model, 4)) == counted + extra
        assert sum(t5_stage_parameters(model, 4, tp=4)) < counted / 2


def test_t5_decoder_length_is_the_data_target_length():
    # training.t5_data builds its samples from the same core.models.t5.span shape: 512 encoder tokens
    # -> raw windows of 567 (noise 85-86 tokens, at most 29 spans), targets of 86 + 29 + 1.
    assert t5_decoder_length(512) == 116
    assert t5_decoder_length(512, tp=8, sequence_parallel=True) == 120
    from tessera.training.t5_data import fit_raw_length

    assert fit_raw_length(512).target_length == 116


def test_t5_flops_by_hand_and_by_flop_counter():
    model = ModelConfig.from_name("t5-tiny")  # h 64, 4 heads x 16, f 128 (gated), V 512, 2 + 2
    B, s_e, s_d = 2, 32, 9
    # By hand, forward: encoder layer 2 x 64 tokens x (4 x 64 x 64 + 3 x 64 x 128 = 40,960)
    # = 5,242,880 + attention 4 x 64 x 32 x 64 = 524,288, in all 5,767,168; decoder layer
    # 2 x 18 x (6 x 64 x 64 + 3 x 64 x 128 = 49,152) = 1,769,472 + cross k, v 2 x 64 x
    # (2 x 64 x 64) = 1,048,576 + attention 4 x 18 x (9 + 32) x 64 = 188,928, in all
    # 3,006,976; output 2 x 18 x 64 x 512 = 1,179,648. Step = 3 x (2 x 5,767,168 +
    # 2 x 3,006,976 + 1,179,648) = 3 x 18,727,936 = 56,183,808.
    assert t5_flops_per_step(model, B, s_e, s_d) == 56_183_808
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    hf = _hf(model, "cpu").float()
    enc = torch.randint(2, model.vocab_size, (B, s_e))
    labels = torch.randint(2, model.vocab_size, (B, s_d))
    with FlopCounterMode(display=False) as counter:
        hf(input_ids=enc, labels=labels).loss.backward()
    assert counter.get_total_flops() == 56_183_808


@pytest.mark.parametrize("preset, overrides, pps", [
    ("t5-base", {}, (2, 3, 4, 6)),
    ("t5-tiny", dict(options=dict(num_decoder_layers=4)), (2, 3, 6)),
    ("t5-tiny", ORIGINAL, (2, 3, 4)),  # tied: the last stage holds a copy of the embedding
])
def test_t5_stage_parameters_equal_tessera_stages(preset, overrides, pps):
    """Per pipeline stage, the planner's count is what `core.models.t5.model.T5Model` builds for that
    stage (on the meta device; tp 1), so the busiest stage's memory is the real one's."""
    from tessera.core.config import Layout
    from tessera.core.models.t5.model import T5Model

    model = ModelConfig.from_name(preset, **overrides)
    for pp in pps:
        with torch.device("meta"):
            built = [sum(p.numel() for p in T5Model(model, Layout(pp=pp), stage_id=k,
                                                    num_stages=pp).parameters())
                     for k in range(pp)]
        assert t5_stage_parameters(model, pp) == built, pp


@pytest.mark.parametrize("preset", ["t5-base", "t5-tiny"])
def test_t5_tp_rank_parameters_equal_the_sharding_rules(preset):
    """One tp rank's count (pp 1) is the sum of `core.parallel.sharding.local_shape` over the
    model's parameters: heads, FFN and vocabulary rows split, norms replicated."""
    import math

    from tessera.core.parallel.sharding import global_param_shapes, local_shape

    model = ModelConfig.from_name(preset)
    for tp in (1, 2, 4):
        local = sum(math.prod(local_shape(n, model, tp)) for n in global_param_shapes(model))
        assert t5_stage_parameters(model, 1, tp) == [local], tp
