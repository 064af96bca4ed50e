"""`tessera tune` into a directory that already holds a tuning run: refused without --resume or
--overwrite; --overwrite gives exactly the prompts of a run into an empty directory."""

from __future__ import annotations

import json
import os
import stat

import torch

from tessera.core.prompt_table import read_prompt_table
from tessera.tuning import cli
from tessera.tuning.config import load_config
from tessera.tuning.loop import tune
from tests.unit.tuning.tuning_helper import tune_argv

SHORT = ("--steps", "3", "--method", "prompt-tuning")


def test_rerun_is_refused_and_overwrite_equals_a_fresh_run(base, data, tmp_path, capsys):
    run = tmp_path / "run"
    cfg, _ = load_config(tune_argv(base, run, data["kind_train"], None, *SHORT, "--seed", "5"))
    tune(cfg)
    manifest = (run / "prompts.json").read_bytes()
    capsys.readouterr()

    assert cli.main(tune_argv(base, run, data["kind_train"], None, *SHORT, "--resume", "no")) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err, err
    assert (run / "prompts.json").read_bytes() == manifest
    # --resume auto (the default) continues only the same config: another seed is refused.
    assert cli.main(tune_argv(base, run, data["kind_train"], None, *SHORT)) == 2
    err = capsys.readouterr().err
    assert "another config" in err and "train.seed: 5 -> 1234" in err, err
    assert (run / "prompts.json").read_bytes() == manifest

    cfg, _ = load_config(tune_argv(base, run, data["kind_train"], None, *SHORT, "--overwrite"))
    tune(cfg)
    cfg, _ = load_config(tune_argv(base, tmp_path / "fresh", data["kind_train"], None, *SHORT))
    tune(cfg)
    _, got = read_prompt_table(run)
    _, want = read_prompt_table(tmp_path / "fresh")
    assert torch.equal(got["kind"], want["kind"])
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text()
             .splitlines()]
    assert [s for s in steps if s is not None] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-00000003"]
    # The same config again: --resume auto continues the (finished) run, logging no step twice.
    assert cli.main(tune_argv(base, run, data["kind_train"], None, *SHORT)) == 0
    assert "resumed from" in capsys.readouterr().out
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text()
             .splitlines()]
    assert [s for s in steps if s is not None] == [1, 2, 3]
    # The prompt table is as readable as any file the run opened itself (not safetensors' 0600).
    assert stat.S_IMODE(os.stat(run / "prompts.safetensors").st_mode) == \
        stat.S_IMODE(os.stat(run / "metrics.jsonl").st_mode)
