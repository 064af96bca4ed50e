"""T5 pieces on one process: relative-position buckets equal transformers' own, the KV-cached
decode equals the full decoder pass, the pipeline split and decoder-only flags fail clearly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.models.t5.init import build_t5_model
from tessera.core.models.t5.layout import t5_stage_layers, t5_stage_split
from tessera.core.models.t5.model import T5Cache, relative_position_buckets

SMALL = ModelConfig.from_name("t5-tiny", vocab_size=64, hidden_size=32, ffn_hidden_size=64)


@pytest.mark.parametrize("buckets,distance", [(32, 128), (8, 20)])
def test_buckets_equal_transformers(buckets, distance):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = torch.arange(-300, 301).unsqueeze(0) - torch.arange(0, 5).unsqueeze(1)
    for bidirectional in (True, False):
        want = t5.T5Attention._relative_position_bucket(relative, bidirectional, buckets,
                                                         distance)
        got = relative_position_buckets(relative, bidirectional, buckets, distance)
        assert torch.equal(got, want)


@torch.no_grad()
def test_cached_decode_equals_the_full_decoder_pass():
    model = build_t5_model(SMALL, seed=3).eval()
    enc_ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    dec_ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    full = model(enc_ids, decoder_input_ids=dec_ids)
    enc, cache = model.encode(enc_ids), T5Cache()
    steps = [model.decode(dec_ids[:, :3], enc, None, cache)]  # a prefill, then single tokens
    steps += [model.decode(dec_ids[:, t:t + 1], enc, None, cache) for t in range(3, 7)]
    assert cache.length == 7
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_pipeline_split_follows_the_layer_counts_and_names_a_bad_one():
    config = ModelConfig.from_name("t5-tiny", num_layers=4, num_decoder_layers=2)
    assert t5_stage_split(config, 3) == 2  # 4 encoder layers on 2 stages, 2 decoder on 1
    assert [t5_stage_layers(s, 3, config) for s in range(3)] == [
        (range(0, 2), range(0)), (range(2, 4), range(0)), (range(0), range(0, 2))]
    with pytest.raises(ConfigError, match="cannot split over 1 encoder \\+ 3 decoder"):
        t5_stage_split(config, 4, encoder_stages=1)


def test_decoder_only_flags_are_refused():
    bad = ModelConfig.from_name("t5-tiny", activation="swiglu", position="rope", bias=True)
    with pytest.raises(ConfigError) as err:
        build_t5_model(bad)
    for field in ("activation", "position", "bias"):
        assert field in str(err.value)
    # Tying and output scaling are separate facts (transformers 5 has both combinations).
    build_t5_model(ModelConfig.from_name("t5-tiny", scaled_output=True))


def test_dropout_is_applied_only_in_training():
    model = build_t5_model(dataclasses.replace(SMALL, dropout=0.2), seed=1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    a = model(ids, decoder_input_ids=ids)
    model.eval()
    with torch.no_grad():
        b, c = model(ids, decoder_input_ids=ids), model(ids, decoder_input_ids=ids)
    assert torch.equal(b, c) and not torch.allclose(a, b)


def test_t5_base_preset_has_t5_v1_1_base_parameter_count():
    from tessera.core.parallel.sharding import num_parameters

    # google/t5-v1_1-base: 247,577,856 parameters (embedding, untied lm_head, 12 + 12 layers)
    assert num_parameters(ModelConfig.from_name("t5-base")) == 247_577_856


def test_layouts_are_checked_for_t5():
    from tessera.core.config import Layout

    tiny = ModelConfig.from_name("t5-tiny")  # 2 + 2 layers: pp 4 is one layer per stage
    assert Layout(pp=4).problems(tiny) == []
    problems = " ".join(Layout(pp=2, virtual_stages=2, cp=2).problems(tiny))
    assert "without context parallelism" in problems and "one pipeline stage per rank" in problems
    three = ModelConfig.from_name("t5-tiny", num_layers=3, num_decoder_layers=3)
    assert "cannot split over" in " ".join(Layout(pp=4).problems(three))
