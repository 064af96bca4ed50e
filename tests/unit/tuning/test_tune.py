"""Tuning in one process: the base stays bit-identical, only prompts get gradients and are
saved, resume is exact (LSTM encoder included), and `--evaluate` reproduces the run's metrics."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors import safe_open

from tessera.core.checkpoint import CheckpointReader
from tessera.core.prompt_table import read_prompt_table
from tessera.training.loop import train_step
from tessera.tuning import cli
from tessera.tuning.checkpoint import STATE_FILE
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.unit.tuning.tuning_helper import tune_argv


def test_base_is_bit_identical_and_only_prompts_get_gradients(base, data, tmp_path):
    cfg, _ = load_config(tune_argv(base, tmp_path / "run", data["kind_train"], None,
                                   "--method", "p-tuning", "--micro-batches", "2"))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reader = CheckpointReader(base)
    for step in range(3):
        tokens, labels = train_batch(t, inputs.train, step)
        train_step(t.job, step, tokens, labels)
        for name, p in model.named_parameters():
            hooked = name.startswith("embedding_hook.")
            assert (p.grad is not None) == hooked, name
            if hooked:
                assert p.grad.abs().sum() > 0, name
    optimized = {id(p) for group in t.job.optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        if name.startswith("embedding_hook."):
            assert id(p) in optimized and not torch.equal(p, before[name]), name
        else:
            assert id(p) not in optimized and torch.equal(p, before[name]), name
            assert torch.equal(p, reader.global_tensor(name)), name


def test_checkpoints_hold_only_prompts_and_resume_exactly(base, data, tmp_path):
    extra = ("--method", "p-tuning", "--encoder", "lstm", "--steps", "8", "--save-interval", "4",
             "--keep-last", "5")
    whole = tmp_path / "whole"
    cfg, _ = load_config(tune_argv(base, whole, data["kind_train"], None, *extra))
    tune(cfg)
    state = whole / "checkpoints" / "step-00000004"
    with safe_open(str(state / STATE_FILE), framework="pt") as f:
        names = list(f.keys())
    assert names and all(n.split("/")[-1].startswith("prompts.kind.") for n in names)
    assert any(".lstm." in n for n in names)  # the LSTM is saved (and restored: see below)

    part = tmp_path / "part"  # the run as it was after its step-4 checkpoint
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(state, part / "checkpoints" / state.name)
    cfg, _ = load_config(tune_argv(base, part, data["kind_train"], None, *extra, "--resume"))
    summary = tune(cfg)
    assert summary["steps"] == 8 and len(summary["losses"]) == 4
    _, a = read_prompt_table(whole)
    _, b = read_prompt_table(part)
    assert torch.equal(a["kind"], b["kind"])


def test_evaluate_reports_the_runs_metrics(base, data, tmp_path, capsys):
    run = tmp_path / "run"
    cfg, _ = load_config(tune_argv(base, run, data["kind_train"], data["kind_valid"],
                                   "--steps", "10"))
    after = tune(cfg)["after"]["kind"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["summary"]["tasks"][0]["accuracy"] == after["accuracy"]
    capsys.readouterr()
    assert cli.main(["--evaluate", "--prompts", str(run), "--data", str(data["kind_valid"]),
                     "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert f"{after['loss']:.4f}" in table and f"{100 * after['accuracy']:.1f}%" in table


def test_long_inputs_are_truncated_and_counted(base, data, tmp_path, capsys):
    rows = [json.loads(line) for line in data["kind_train"].read_text().splitlines()]
    rows[0]["input"] = " ".join([rows[0]["input"]] * 30)  # far past the 128-token context
    rows[1]["input"] = " ".join([rows[1]["input"]] * 30)
    train = tmp_path / "long.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert cli.main(tune_argv(base, tmp_path / "run", train, None, "--steps", "2")) == 0
    out = capsys.readouterr().out
    assert "truncated 2 training examples of task 'kind' (field 'input')" in out
