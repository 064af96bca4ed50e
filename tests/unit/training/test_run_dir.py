"""A run directory holds one run: a re-run continues it when its config is the same (`--resume
auto`, the default) and is refused when it is not or with `--resume false`, --overwrite starts
over exactly as a run into an empty directory would, and the model's vocabulary follows the
tokenizer unless the user sets it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tessera.core.checkpoint import read_manifest
from tessera.core.config import ConfigError
from tessera.core.tokenizer import load_tokenizer, train_tokenizer
from tessera.training import cli
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tessera.training.preprocess import main as preprocess
from tessera.training.run_dir import claim_run_dir
from tessera.training.state import latest_checkpoint
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


SHORT = ("--steps", "3", "--save-interval", "0")


def test_rerun_is_refused_and_overwrite_equals_a_fresh_run(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(pretrain_argv(tiny, run, *SHORT, "--seed", "7")) == 0
    (run / "data").mkdir()
    (run / "data" / "keep.txt").write_text("not the run's")  # e.g. the demo's data
    metrics = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    assert cli.main(pretrain_argv(tiny, run, *SHORT, "--resume", "false")) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing touched
    # auto (the default) and another config: refused, naming the difference.
    assert cli.main(pretrain_argv(tiny, run, *SHORT, "--lr", "1e-3")) == 2
    err = capsys.readouterr().err
    assert "another config" in err and "train.lr: 0.003 -> 0.001" in err, err
    assert "--resume true" in err and "--overwrite" in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics

    assert cli.main(pretrain_argv(tiny, run, *SHORT, "--resume", "--overwrite")) == 2
    assert "contradict" in capsys.readouterr().err

    # --overwrite with other steps and seed: the result is exactly a run into an empty directory.
    cfg, _ = load_config(pretrain_argv(tiny, run, "--steps", "2", "--save-interval", "0",
                                       "--overwrite"))
    summary = pretrain(cfg)
    cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "fresh", "--steps", "2",
                                       "--save-interval", "0"))
    fresh = pretrain(cfg)
    assert read_losses(run) == read_losses(tmp_path / "fresh") and len(read_losses(run)) == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r] == [1, 2]  # no lines of the old run
    assert latest_checkpoint(run).name == "step-00000002" == Path(fresh["checkpoint"]).name
    assert summary["checkpoint"] == str(run / "checkpoints" / "step-00000002")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000002"]
    assert (run / "data" / "keep.txt").read_text() == "not the run's"
    assert not [p for p in run.iterdir() if "overwritten" in p.name]


def test_auto_continues_the_same_run_and_restarts_one_that_never_saved(tiny, tmp_path):
    """`--resume auto` with no flag changed: a run killed after its step-4 checkpoint continues
    from it, each step logged once; one killed before its first save starts over, its rows gone."""
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, "--steps", "6", "--save-interval", "4")
    pretrain(load_config(argv)[0])
    full = (run / "metrics.jsonl").read_text()
    # As a kill at step 6 leaves it: steps 5-6 logged (the last torn), the checkpoint at 4.
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    (run / "checkpoints" / "latest").write_text("step-00000004\n")
    rows = full.splitlines(keepends=True)[:6]
    (run / "metrics.jsonl").write_text("".join(rows[:-1]) + rows[-1][:20])
    summary = pretrain(load_config(argv)[0])
    assert summary["steps"] == 6 and summary["first_loss"] is not None
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, None]  # each step once, then the summary
    assert read_losses(run) == read_losses_of(full)

    never_saved = tmp_path / "never-saved"
    (never_saved / "checkpoints").mkdir(parents=True)
    (never_saved / "metrics.jsonl").write_text("".join(rows[:3]))
    pretrain(load_config(pretrain_argv(tiny, never_saved, "--steps", "6", "--save-interval", "4"))[0])
    lines = (never_saved / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines] == steps  # the dead rows are gone
    assert read_losses(never_saved) == read_losses_of(full)


def read_losses_of(metrics: str) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.splitlines()]
    return {r["step"]: r["loss"] for r in rows if "step" in r}


def test_resume_true_is_required_to_continue_with_another_config(tiny, tmp_path):
    run = tmp_path / "run"
    pretrain(load_config(pretrain_argv(tiny, run, *SHORT))[0])
    summary = pretrain(load_config(pretrain_argv(tiny, run, *SHORT, "--steps", "4",
                                                 "--resume", "true"))[0])
    assert summary["steps"] == 4 and sorted(read_losses(run)) == [1, 2, 3, 4]


@pytest.mark.parametrize("written, mode", [("true", "true"), ("yes", "true"), ("false", "false"),
                                           ("auto", "auto"), ("0", "false")])
def test_resume_reads_every_spelling_in_yaml_and_flags(tmp_path, written, mode):
    config = tmp_path / "run.yaml"
    config.write_text(f"loop:\n  resume: {written}\n")
    assert load_config(["--config", str(config)])[0].loop.resume == mode
    assert load_config(["--resume", written])[0].loop.resume == mode
    assert load_config(["--resume"])[0].loop.resume == "true"
    assert load_config([])[0].loop.resume == "auto"


def test_a_bad_resume_value_is_one_clear_error(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("resume: sometimes\n")
    with pytest.raises(ConfigError, match="resume: expected auto, true or false, got 'sometimes'"):
        load_config(["--config", str(config)])
    assert cli.main(["--max-restarts", "2", "--steps", "1"]) == 2
    assert "--max-restarts restarts the ranks that --nproc-per-node starts" in capsys.readouterr().err


def test_claim_counts_only_a_runs_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints").mkdir()  # empty: a run that never saved
    (tmp_path / "metrics.jsonl").write_text("")
    claim_run_dir(tmp_path, resume=False, overwrite=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl"):
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    claim_run_dir(tmp_path, resume=True, overwrite=False)  # --resume takes it as it is
    claim_run_dir(tmp_path, resume="auto", overwrite=False)  # no checkpoint: starts over
    assert (tmp_path / "metrics.jsonl").exists()
    claim_run_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "notes.txt"]


# ------------------------------------------------------------------------ vocabulary

@pytest.fixture(scope="module")
def odd_vocab(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    """The tiny corpus under a tokenizer of an unusual size (no preset has it)."""
    directory = tmp_path_factory.mktemp("odd")
    tokenizer = directory / "tok300.model"
    train_tokenizer([tiny.prefix.parent / "corpus.jsonl"], 300, tokenizer, "bpe", num_threads=1)
    prefix = directory / "corpus"
    assert preprocess(["--input", str(tiny.prefix.parent / "corpus.jsonl"), "--tokenizer",
                       str(tokenizer), "--output-prefix", str(prefix), "--workers", "1"]) == 0
    return TinyData(prefix, tokenizer, load_tokenizer(tokenizer).vocab_size)


def test_vocabulary_follows_the_tokenizer(odd_vocab, tmp_path):
    assert odd_vocab.vocab_size == 300
    # `--model-overrides` given again replaces pretrain_argv's (which sets vocab_size).
    argv = pretrain_argv(odd_vocab, tmp_path / "run", *SHORT, "--model-overrides", "num_layers=2")
    cfg, _ = load_config(argv)
    assert cfg.model.vocab_size != 300  # the preset's default
    summary = pretrain(cfg)
    manifest = read_manifest(summary["checkpoint"])
    assert manifest.model.vocab_size == 300 and manifest.model.num_layers == 2
    losses = read_losses(tmp_path / "run")
    assert len(losses) == 3 and all(v == v for v in losses.values())


@pytest.mark.parametrize("how", ["flag", "yaml"])
def test_an_explicit_vocab_size_that_differs_is_an_error(odd_vocab, tmp_path, capsys, how):
    extra: tuple[str, ...] = ("--model-overrides", "vocab_size=512")
    if how == "yaml":
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({"model": {"preset": "llama-tiny", "vocab_size": 512}}))
        extra = ("--config", str(config), "--model-overrides", "num_layers=2")
    assert cli.main(pretrain_argv(odd_vocab, tmp_path / "run", *SHORT, *extra)) == 2
    err = capsys.readouterr().err
    assert "vocab_size is set to 512" in err and "vocabulary of 300" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_explicit_vocab_size_that_agrees_is_kept(odd_vocab, tmp_path):
    cfg, _ = load_config(pretrain_argv(odd_vocab, tmp_path / "run", *SHORT, "--steps", "1",
                                       "--model-overrides", "vocab_size=300", "num_layers=1"))
    assert read_manifest(pretrain(cfg)["checkpoint"]).model.vocab_size == 300


def test_a_refused_run_leaves_no_directory_behind(tiny, tmp_path, capsys):
    """Refused after the output directory was made (the layout is checked once the data is):
    the directories the run made are taken back; one that existed before stays."""
    out = tmp_path / "new" / "run"
    assert cli.main(pretrain_argv(tiny, out, "--seq-len", "100000")) == 2
    assert "exceeds the model's max_position_embeddings" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    assert cli.main(pretrain_argv(tiny, out, "--seq-len", "100000")) == 2
    assert out.is_dir()
