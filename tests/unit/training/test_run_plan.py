"""`training.run_plan.resolve_plan`: the written config resolved once into frozen sections."""

import dataclasses

import pytest

from tessera.core.config import ConfigError
from tessera.training.config import load_config
from tessera.training.demo import demo_config, demo_fills_pipeline
from tessera.training.run_plan import resolve_plan

TINY = ["--model", "llama-tiny", "--data", "corpus", "--seq-len", "32"]


def test_dp_and_the_batch_split_are_derived_once_from_the_world():
    cfg, _ = load_config([*TINY, "--tp", "2", "--global-batch", "12", "--micro-batches", "3",
                          "--steps", "5", "--eval-batches", "2"])
    plan = resolve_plan(cfg, 4)
    assert (plan.layout.tp, plan.layout.dp, plan.schedule.micro_batches) == (2, 2, 3)
    assert (plan.data.per_dp_batch, plan.data.micro_batch_size) == (6, 2)
    assert (plan.data.train_samples, plan.data.valid_samples) == (60, 24)
    assert plan.optimizer.steps == plan.run.steps == 5
    assert cfg.parallel.dp == 1  # the written config stays as written


def test_the_plan_and_the_written_config_are_frozen():
    cfg, _ = load_config(TINY)
    plan = resolve_plan(cfg, 1)
    for obj, name in ((plan, "model"), (plan.schedule, "micro_batches"), (plan.data, "seq_len"),
                      (plan.loop, "output"), (cfg.parallel, "micro_batches"), (cfg, "model")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)


def test_the_record_is_the_written_config_with_the_resolved_values():
    cfg, _ = load_config([*TINY, "--pp", "2", "--global-batch", "8", "--micro-batches", "2"])
    record = resolve_plan(cfg, 4).record
    written = cfg.to_dict()
    assert record["parallel"] == {**written["parallel"], "dp": 2}
    assert {**record, "parallel": written["parallel"]} == written


def test_the_demo_fills_the_pipeline_unless_micro_batches_are_given():
    cfg, _ = load_config(["--pp", "2", "--virtual-stages", "2", "--schedule",
                          "interleaved-1f1b", "--global-batch", "16"])
    demo = demo_config(cfg, {"pp", "virtual_stages", "schedule", "global_batch"})
    assert (demo.train.steps, demo.loop.output, demo.loop.overwrite) == (300, "runs/demo", False)
    plan = resolve_plan(demo, 2, fill_pipeline=demo_fills_pipeline({"pp"}))
    assert plan.schedule.micro_batches == 8 == plan.record["parallel"]["micro_batches"]
    assert not demo_fills_pipeline({"micro_batches"})
    one_stage, _ = load_config(["--global-batch", "16"])
    assert resolve_plan(one_stage, 1, fill_pipeline=True).schedule.micro_batches == 1


def test_a_weights_only_plan_fits_any_layout():
    cfg, _ = load_config(["--model", "llama-tiny", "--pp", "2", "--tp", "2", "--global-batch",
                          "3", "--seq-len", "7"])
    plan = resolve_plan(cfg, 4, weights_only=True)
    assert plan.schedule.micro_batches == 2 and plan.data.global_batch == 8
    assert plan.data.seq_len == 8
    with pytest.raises(ConfigError, match="global batch 3 is not divisible by dp"):
        resolve_plan(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1)), 4)


@pytest.mark.parametrize(("flags", "world", "message"), [
    (["--global-batch", "8", "--micro-batches", "3"], 1,
     "per-data-parallel batch 8 (global 8 / dp 1) does not split into 3 micro-batches"),
    (["--precision", "fp12"], 1, "unknown precision 'fp12'; use fp32, bf16, bf16-pure"),
    (["--seq-len", "100000"], 1, "seq_len 100000 exceeds the model's max_position_embeddings"),
    (["--data-parallel", "zero1", "--precision", "fp16"], 2,
     "data_parallel 'zero1' does not support fp16's gradient scaler"),
    (["--tp", "3"], 3, "num_heads 4 is not divisible by tp 3"),
])
def test_what_cannot_run_is_one_config_error(flags, world, message):
    cfg, _ = load_config([*TINY, *flags])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_plan(cfg, world)


@pytest.mark.parametrize(("field", "message"), [
    ("micro_batches", "micro_batches must be >= 1, got 0"), ("dp", "dp must be >= 1, got 0")])
def test_a_zero_that_reaches_the_resolver_is_a_config_error(field, message):
    """Flags and YAML refuse these at parse time; a config built in Python still reaches the
    resolver's own check (a message, not a ZeroDivisionError)."""
    cfg, _ = load_config(TINY)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **{field: 0}))
    with pytest.raises(ConfigError, match=message):
        resolve_plan(cfg, 1)


def test_the_prepare_step_comes_before_the_checks_and_its_model_is_checked_and_recorded():
    cfg, _ = load_config([*TINY, "--tp", "2"])

    def refuse(plan):
        raise ConfigError("the data says no")

    with pytest.raises(ConfigError, match="the data says no"):
        resolve_plan(cfg, 1, prepare=refuse)  # before the world size (1 != tp 2) is checked
    wider = resolve_plan(cfg, 2, prepare=lambda plan: plan.with_model(
        dataclasses.replace(plan.model, vocab_size=999)))
    assert wider.record["model"]["vocab_size"] == 999 and wider.model.vocab_size == 999
    assert resolve_plan(cfg, 2).record["model"]["vocab_size"] == cfg.model.vocab_size
    with pytest.raises(ConfigError, match="num_heads 1 is not divisible by tp 2"):
        resolve_plan(cfg, 2, prepare=lambda plan: plan.with_model(
            dataclasses.replace(plan.model, num_heads=1, num_kv_heads=1)))


def test_a_changed_collective_timeout_is_not_another_config():
    """`--resume auto` continues a run whose checkpoints record another timeout (or none)."""
    from tessera.training.run_dir import config_changes

    default = resolve_plan(load_config([])[0], 1).record
    longer = resolve_plan(load_config(["--collective-timeout-s", "1800"])[0], 1)
    assert longer.loop.collective_timeout_s == 1800
    assert config_changes(default, longer.record) == ""
