"""`tessera pretrain --model t5-tiny` in one process: the span-corruption loss falls on the tiny
corpus, a resumed run repeats the uninterrupted one bit for bit, `tessera evaluate` prints the
span-corruption loss and token accuracy, and what T5 cannot do (decoder-only flags, prompt
tuning, a vocabulary without room for the sentinels, data without a tokenizer) fails with a
message that says so before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.core.checkpoint import read_manifest
from tessera.training import cli
from tessera.training.config import load_config
from tessera.training.evaluate_cli import main as evaluate_main
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses, rewind_run

STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


def t5_argv(tiny: TinyData, run: Path, *extra: str) -> list[str]:
    # The override list replaces the helper's: vocab_size follows the tokenizer (+ 100 sentinels).
    return pretrain_argv(tiny, run, "--model-overrides", "dropout=0.0", "--steps", str(STEPS),
                         "--save-interval", "6", *extra, model="t5-tiny")


@pytest.fixture(scope="module")
def run12(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("t5") / "run"
    cfg, _ = load_config(t5_argv(tiny, run))
    summary = pretrain(cfg)
    assert summary["steps"] == STEPS
    # The vocabulary follows the tokenizer, with room for the family's special tokens.
    assert read_manifest(summary["checkpoint"]).model.vocab_size == tiny.vocab_size + 100
    return run


def test_loss_falls_and_evaluate_reports_span_loss(tiny, run12, capsys):
    losses = read_losses(run12)
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (10, 11, 12)) / 3
    assert last < first - 1.0, losses
    path = latest_checkpoint(run12)
    manifest = read_manifest(path)
    assert manifest.model.family == "t5" and manifest.extra["training"]["step"] == STEPS
    argv = ["--checkpoint", str(path), "--data", str(tiny.prefix), "--seq-len", "32",
            "--split", "all", "--max-windows", "64"]
    assert evaluate_main(argv) == 0
    out = capsys.readouterr().out
    assert "span-corruption loss" in out and "token accuracy" in out, out
    loss = float(out.split("span-corruption loss ")[1].split()[0])
    accuracy = float(out.split("token accuracy ")[1].split()[0])
    assert loss < losses[1] - 1.0  # the trained model, not the initial one
    assert 0.05 < accuracy <= 1.0  # well above chance (1 / 420) after 12 steps
    assert evaluate_main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(loss, abs=1e-4) and result["tokens"] > 0


def test_resume_is_bit_identical(tiny, run12, tmp_path):
    part = tmp_path / "part"
    rewind_run(run12, part, 6)
    cfg, _ = load_config(t5_argv(tiny, part, "--resume"))
    pretrain(cfg)
    full, resumed = read_losses(run12), read_losses(part)
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert [resumed[s] for s in range(7, STEPS + 1)] == [full[s] for s in range(7, STEPS + 1)]


@pytest.mark.parametrize("flags, message", [
    (("--isolate-documents",), "--isolate-documents is for packed decoder samples"),
    (("--cp", "2"), "--cp 2: context parallelism"),
    (("--model-overrides", "vocab_size=400"), "set vocab_size to at least 420"),
    (("--virtual-stages", "2", "--pp", "2"), "one pipeline stage per rank"),
    (("--tokenizer", ""), "pass --tokenizer"),
])
def test_what_t5_cannot_do_is_refused(tiny, tmp_path, capsys, flags, message):
    assert cli.main(t5_argv(tiny, tmp_path / "run", *flags)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


def test_prompt_tuning_a_t5_is_refused(run12, tmp_path, capsys):
    from tessera.tuning.cli import main as tune_main

    assert tune_main(["--checkpoint", str(latest_checkpoint(run12)),
                      "--output", str(tmp_path / "tune")]) != 0
    err = capsys.readouterr().err
    assert "--method p-tuning is not supported for a T5 base" in err
    assert "T5 tunes with --method lora" in err


def test_demo_prints_span_fills(run12, capsys):
    """The demo's closing samples for a T5: each prompt's `<extra_id_0>` span filled, greedy."""
    from tessera.training.t5_demo import DEMO_T5_PROMPTS, print_t5_samples

    print_t5_samples(str(latest_checkpoint(run12)), max_new_tokens=4)
    out = capsys.readouterr().out
    assert "span fills (greedy)" in out and all(repr(p) in out for p in DEMO_T5_PROMPTS), out
