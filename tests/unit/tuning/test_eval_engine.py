"""`--eval-engine`: held-out conversations are answered through the serving engine
(`LLMEngine`, as `tessera serve` runs it) with the adapter merged, and those answers equal the
tuning loop's own greedy generation token for token; the run's validation metrics are the same
either way; the flag is refused where the engine cannot follow the run."""

from __future__ import annotations

import json

import pytest

from tessera.core import build_model, save_checkpoint
from tessera.core.config import ModelConfig
from tessera.serving.engine_answers import greedy_answers
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.evaluate import _engine_answers, generate_answers
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.unit.tuning.chat_fixtures import QWEN25, raw_tokenizer
from tests.unit.tuning.tuning_helper import tune_argv

WORDS = "alpha beta gamma delta parse decode value error object string".split()
LORA = ("--method", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
        "--lr", "1e-2", "--global-batch", "4", "--steps", "6")


def _rows(n: int, seed: int) -> list[dict]:
    import random

    rng, rows = random.Random(seed), []
    for _ in range(n):
        pick = rng.sample(WORDS, 3)
        rows.append({"messages": [{"role": "user", "content": " ".join(pick)},
                                  {"role": "assistant", "content": " ".join(reversed(pick))}]})
    return rows


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval-engine")
    raw = raw_tokenizer(QWEN25)
    (root / "tok").mkdir()
    raw.save(str(root / "tok" / "tokenizer.json"))
    config = ModelConfig.from_name("llama-tiny", vocab_size=raw.get_vocab_size(),
                                   num_layers=2, max_position_embeddings=256)
    base = save_checkpoint(root / "base", build_model(config, seed=3),
                           tokenizer=root / "tok" / "tokenizer.json")
    (base / "chat_template.jinja").write_text(QWEN25.template)
    files = {}
    for name, n, seed in (("train", 24, 0), ("valid", 6, 1)):
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in _rows(n, seed)))
    return {"root": root, "base": base, **files}


def _argv(s: dict, out: str, *extra: str) -> list[str]:
    return tune_argv(s["base"], s["root"] / out, s["train"], s["valid"], *LORA, *extra)


def test_engine_answers_equal_the_loops_generation_token_for_token(setting):
    cfg, _ = load_config(_argv(setting, "steps", "--eval-engine"))
    inputs = prepare_inputs(cfg, train=cfg.tune.data, valid=cfg.tune.valid)
    t = setup(cfg, inputs)
    for step in range(4):
        train_step(t.job, step, *train_batch(t, inputs.train, step))
    t.engine_answers = greedy_answers
    examples = inputs.valid.examples
    engine = _engine_answers(t, examples)
    loop = [a for i in range(0, len(examples), 2) for a in generate_answers(t, examples[i:i + 2])]
    assert engine == loop
    assert all(len(a) >= 3 for a in engine)  # real answers, compared token for token


def test_a_run_with_eval_engine_reports_what_the_loop_reports(setting):
    plain = tune(load_config(_argv(setting, "plain"))[0])
    served = tune(load_config(_argv(setting, "engine", "--eval-engine"))[0],
                  engine_answers=greedy_answers)
    assert served["after"] == plain["after"] and served["losses"] == plain["losses"]
    assert served["after"]["chat"]["examples"] == 6


@pytest.mark.parametrize("extra, message", [
    (("--method", "p-tuning"), "--eval-engine needs --method lora or full"),
    (("--tp", "2"), "--eval-engine runs in one process"),
])
def test_eval_engine_is_refused_where_the_engine_cannot_follow(setting, extra, message):
    from tessera.core.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(_argv(setting, "refused", "--eval-engine", *extra))


def test_the_root_command_hands_the_engine_to_tune(setting, capsys):
    from tessera.__main__ import main
    from tessera.tuning.cli import main as tune_main

    assert tune_main(_argv(setting, "alone", "--eval-engine")) == 2  # tuning has no engine
    assert "--eval-engine needs the serving engine" in capsys.readouterr().err
    assert main(["tune", *_argv(setting, "cli", "--eval-engine")]) == 0
