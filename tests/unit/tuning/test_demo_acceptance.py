"""Slow acceptance on the real demo base: pretrain the demo (a few minutes on 2 cores), then
p-tune and prompt-tune the `doc_kind` task of `tuning.demo_task` and score its held-out split.
Run by `make test-slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tessera.tuning.config import load_config
from tessera.tuning.demo_task import write_splits
from tessera.tuning.loop import tune


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.usefixtures("compiled_kernels")  # the demo as users run it: default kernels
def test_p_tuning_on_the_demo_base(tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FUSED_KERNELS": "auto"}
    subprocess.run([sys.executable, "-m", "tessera", "pretrain", "--output",
                    str(tmp_path / "demo"), "--progress", "false"], check=True, env=env)
    base = tmp_path / "demo" / "checkpoints" / "step-00000300"
    splits = write_splits(tmp_path / "task")
    figures = {}
    for method, lr, min_lr in (("p-tuning", "1e-2", "1e-3"), ("prompt-tuning", "1e-1", "1e-2")):
        cfg, _ = load_config([
            "--checkpoint", str(base), "--data", str(splits["train"]),
            "--valid", str(splits["test"]),  # scored before and after: the held-out split
            "--method", method, "--encoder", "mlp", "--virtual-tokens", "10", "--steps", "300",
            "--lr", lr, "--min-lr", min_lr, "--add-eos", "false", "--eval-interval", "0",
            "--save-interval", "0", "--progress", "false", "--output", str(tmp_path / method)])
        summary = tune(cfg)
        figures[method] = (summary["before"]["doc_kind"]["accuracy"],
                           summary["after"]["doc_kind"]["accuracy"])
    with capsys.disabled():
        for method, (before, after) in figures.items():
            print(f"\n  demo base, {method:<14} held-out exact match: {before:.1%} -> {after:.1%}")
    before, after = figures["p-tuning"]
    assert before <= 0.5 and after >= 0.85, figures
