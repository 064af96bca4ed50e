"""Every invalid layout raises a ConfigError that names the numbers and the fix."""

import re

import pytest

from tessera.core import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.parallel.pipeline import split_layout_and_schedule, validate_training
from tessera.core.parallel.sharding import num_parameters


def _par(**fields) -> tuple[Layout, TrainSchedule]:
    """A layout and schedule from the flat `parallel:` fields, as the CLI builds them."""
    return split_layout_and_schedule(fields)


def _error(par: tuple[Layout, TrainSchedule], model: ModelConfig, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_training(model, *par, **kw)
    return str(info.value)


def test_valid_layout_passes():
    model = ModelConfig.from_name("llama-tiny", num_layers=4)
    validate_training(model, *_par(tp=2, pp=2, dp=2, micro_batches=2), world_size=8,
                      global_batch=8)


def test_heads_not_divisible_by_tp():
    msg = _error(_par(tp=3), ModelConfig.from_name("gpt2-tiny"))
    assert "num_heads 4 is not divisible by tp 3" in msg and "[1, 2, 4]" in msg


def test_kv_heads_vs_tp():
    # tp a multiple of num_kv_heads replicates each kv head; tp dividing it splits them.
    for tp in (1, 2, 4):
        Layout(tp=tp).validate(ModelConfig.from_name("llama-tiny"))  # 2 kv heads
    model = ModelConfig(hidden_size=48, num_heads=12, num_kv_heads=4, ffn_hidden_size=48)
    msg = _error(_par(tp=6), model)  # neither divides the other
    assert "num_kv_heads 4 and tp 6: tp must divide num_kv_heads" in msg
    assert "or be a multiple of it" in msg and "[1, 2, 4, 12]" in msg


def test_layers_not_divisible_by_stages():
    msg = _error(_par(pp=2, virtual_stages=2, schedule="interleaved-1f1b"),
                 ModelConfig.from_name("llama-tiny", num_layers=6))
    assert "num_layers 6 is not divisible by pp 2 x virtual_stages 2 = 4" in msg


def test_world_size_mismatch_suggests_dp():
    msg = _error(_par(tp=2, pp=1, dp=1), ModelConfig.from_name("llama-tiny"),
                 world_size=4)
    assert "world size 4 != tp 2 x pp 1 x dp 1 = 2" in msg and "dp = 2" in msg


def test_batch_not_divisible_into_micro_batches():
    msg = _error(_par(dp=2, micro_batches=3), ModelConfig.from_name("llama-tiny"),
                 global_batch=8)
    assert "per-data-parallel batch 4" in msg and "3 micro-batches" in msg


def test_batch_not_divisible_by_dp():
    assert "global batch 7 is not divisible by dp 2" in _error(
        _par(dp=2), ModelConfig.from_name("llama-tiny"), global_batch=7)


def test_schedule_and_virtual_stage_mismatches():
    model = ModelConfig.from_name("llama-tiny", num_layers=4)
    assert "unknown schedule 'nope'" in _error(_par(pp=2, schedule="nope"), model)
    assert "set virtual_stages 2" in _error(_par(pp=2, schedule="zbv"), model)
    assert "interleaved-1f1b" in _error(_par(pp=2, virtual_stages=2), model)


def test_sequence_parallel_needs_tp_and_divisible_sequence():
    model = ModelConfig.from_name("llama-tiny")
    assert "needs tp > 1" in _error(_par(sequence_parallel=True), model)
    assert "sequence length 15 is not divisible by tp 2" in _error(
        _par(tp=2, sequence_parallel=True), model, seq_len=15)


def test_several_problems_reported_together():
    msg = _error(_par(tp=3, pp=4), ModelConfig.from_name("gpt2-tiny"), world_size=5)
    assert msg.count("\n  - ") >= 3


def test_model_config_errors():
    with pytest.raises(ConfigError, match="hidden_size 65 is not divisible by num_heads 4"):
        ModelConfig(hidden_size=65, num_heads=4)
    with pytest.raises(ConfigError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        ModelConfig(hidden_size=48, num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="unknown model preset"):
        ModelConfig.from_name("gpt5")
    with pytest.raises(ConfigError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"hidden": 3})


def test_presets_round_trip_and_real_sizes():
    for name in ("gpt2-124m", "llama2-7b", "llama3-8b", "nemotron4-15b"):
        config = ModelConfig.from_name(name)
        assert ModelConfig.from_dict(config.to_dict()) == config
    # Published parameter counts (GPT-2 124M counts the tied embedding once).
    assert abs(num_parameters(ModelConfig.from_name("gpt2-124m")) / 1e6 - 124.4) < 0.5
    assert abs(num_parameters(ModelConfig.from_name("llama2-7b")) / 1e9 - 6.74) < 0.01
    assert abs(num_parameters(ModelConfig.from_name("llama3-8b")) / 1e9 - 8.03) < 0.01


@pytest.mark.parametrize("option, value", [("attn_logit_softcapping", 50.0),
                                           ("query_pre_attn_scalar", 256)])
def test_gemma2_attention_refuses_context_parallelism_by_field(option, value):
    """Gemma 2's score scale and soft cap are not in the cp attention: a cp layout is refused
    (by `Layout.problems`, so the planner skips it too, and before a run builds anything),
    naming the field and its value; tp with sequence parallelism is accepted."""
    from tessera.core.models.decoder.gemma_options import Gemma2Options

    options = Gemma2Options(**{"query_pre_attn_scalar": None, "attn_logit_softcapping": None,
                               option: value})
    gemma2 = ModelConfig.from_name("llama-tiny", family="gemma2", norm="rmsnorm1p",
                                   activation="geglu", norm_placement="sandwich",
                                   options=options)
    message = rf"cp 2: .*{option}={value}; use cp 1"
    assert any(re.search(message, p) for p in Layout(cp=2).problems(gemma2, seq_len=16))
    with pytest.raises(ConfigError, match=message):
        validate_training(gemma2, Layout(cp=2), TrainSchedule(), world_size=2)
    validate_training(gemma2, Layout(tp=2, sequence_parallel=True), TrainSchedule(),
                      world_size=2)


def test_gemma2_attention_refuses_isolated_documents_in_pretraining(tmp_path):
    """Packed documents kept apart run the same attention as cp: refused before any data is
    read, naming the field."""
    from tessera.training.config import load_config
    from tessera.training.objectives import check_objective
    from tessera.training.run_plan import resolve_plan

    argv = ["--data", str(tmp_path / "none"), "--model", "gemma2-2b", "--seq-len", "64",
            "--global-batch", "2"]
    cfg, _ = load_config([*argv, "--isolate-documents", "true"])
    with pytest.raises(ConfigError, match=r"--isolate-documents: .*query_pre_attn_scalar=256, "
                                          r"attn_logit_softcapping=50.0; train without it"):
        check_objective(resolve_plan(cfg, 1))
    cfg, _ = load_config(argv)
    check_objective(resolve_plan(cfg, 1))
