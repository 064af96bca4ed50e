"""`tessera pretrain --model bert-tiny` in one process: the masked-LM loss falls on the tiny
corpus, a resumed run repeats the uninterrupted one bit for bit, `tessera evaluate` prints the
masked-LM accuracy, and what BERT cannot do (decoder-only flags, prompt tuning, a vocabulary
without room for its special tokens) fails with a message that says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.core.checkpoint import read_manifest
from tessera.training import cli
from tessera.training.config import load_config
from tessera.training.evaluate_cli import main as evaluate_main
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses, rewind_run


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


def bert_argv(tiny: TinyData, run: Path, *extra: str) -> list[str]:
    # The override list replaces the helper's: vocab_size follows the tokenizer (+ 4 specials).
    return pretrain_argv(tiny, run, "--model-overrides", "num_layers=2", "--steps", "16",
                         "--save-interval", "8", *extra, model="bert-tiny")


@pytest.fixture(scope="module")
def run16(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("bert16") / "run"
    cfg, _ = load_config(bert_argv(tiny, run))
    summary = pretrain(cfg)
    assert summary["steps"] == 16
    # The vocabulary follows the tokenizer, with room for the family's special tokens.
    assert read_manifest(summary["checkpoint"]).model.vocab_size == tiny.vocab_size + 4
    return run


def test_loss_falls_and_evaluate_reports_accuracy(tiny, run16, capsys):
    losses = read_losses(run16)
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (14, 15, 16)) / 3
    assert last < first - 0.8, losses
    argv = ["--checkpoint", str(latest_checkpoint(run16)), "--data", str(tiny.prefix),
            "--seq-len", "32", "--split", "all", "--max-windows", "64"]
    assert evaluate_main(argv) == 0
    out = capsys.readouterr().out
    assert "masked-LM loss" in out and "accuracy" in out, out
    accuracy = float(out.split("accuracy ")[1].split()[0])
    assert 0.05 < accuracy <= 1.0  # well above chance (1 / 324) after 16 steps


def test_resume_is_bit_identical(tiny, run16, tmp_path):
    part = tmp_path / "part"
    rewind_run(run16, part, 8)
    cfg, _ = load_config(bert_argv(tiny, part, "--resume"))
    pretrain(cfg)
    full, resumed = read_losses(run16), read_losses(part)
    assert sorted(resumed) == list(range(9, 17))
    assert [resumed[s] for s in range(9, 17)] == [full[s] for s in range(9, 17)]


@pytest.mark.parametrize("flags, message", [
    (("--isolate-documents",), "--isolate-documents is for packed decoder samples"),
    (("--cp", "2"), "--cp 2: context parallelism"),
    (("--model-overrides", "vocab_size=321"), "set vocab_size to at least 324"),
    (("--model-overrides", "binary_head=true", "--pp", "2"), "next-sentence head"),
])
def test_what_bert_cannot_do_is_refused(tiny, tmp_path, capsys, flags, message):
    assert cli.main(bert_argv(tiny, tmp_path / "run", *flags)) == 2
    assert message in capsys.readouterr().err


def test_prompt_tuning_a_bert_is_refused(run16, tmp_path, capsys):
    from tessera.tuning.cli import main as tune_main

    assert tune_main(["--checkpoint", str(latest_checkpoint(run16)),
                      "--output", str(tmp_path / "tune")]) != 0
    assert "needs a decoder (GPT-style) model" in capsys.readouterr().err
