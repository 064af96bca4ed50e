"""The start-of-run banner states what the run does (its numbers checked against a built model
and the data by hand), and MFU is reported against a stated peak, or as n/a."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tessera.core.config import ConfigError, Layout
from tessera.core.init import build_model
from tessera.core.parallel.groups import ParallelGroups
from tessera.training.config import load_config
from tessera.training.indexed_dataset import IndexedDataset
from tessera.training.loop import pretrain
from tessera.training.metrics import known_peak_tflops, resolve_peak
from tests.pretrain_helper import pretrain_argv


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


def test_banner_states_the_run(tiny, tmp_path, capsys):
    argv = pretrain_argv(tiny, tmp_path / "run", "--steps", "3", "--save-interval", "0",
                         "--model-overrides", "num_layers=2")
    argv[argv.index("--peak-tflops") + 1] = "auto"
    cfg, _ = load_config(argv)
    summary = pretrain(cfg)
    out = capsys.readouterr().out
    banner = out[:out.index("step      1")]

    # The run's model: the written one with the tokenizer's vocabulary (the run plan's).
    run_model = dataclasses.replace(cfg.model, vocab_size=tiny.vocab_size)
    model = build_model(run_model, Layout(), ParallelGroups(), device=torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert f"vocab 320: {params / 1e3:.2f}K parameters" in banner, banner
    assert "tp 1 x pp 1 x dp 1 = 1 rank" in banner and "2 micro-batches" in banner
    assert "8 sequences x 32 tokens = 256 tokens/step; 3 steps = 768 tokens" in banner
    # 98,1,1 of 600 documents: the first 588 are the training split.
    train_tokens = int(IndexedDataset(tiny.prefix).lengths[:588].sum())
    assert (f"{768 / train_tokens:.2f} epochs of the training split of {tiny.prefix} "
            f"({train_tokens:,} tokens in 588 documents)") in banner
    assert "fp32 on cpu" in banner and "from global rank 0 of 1" in banner
    assert re.search(r"MFU against\s+n/a \(no known peak for cpu", banner)
    assert "MFU n/a" in out  # the step lines
    assert summary["peak_tflops"] is None and summary["peak_source"] == "no known peak for cpu"


def test_peak_from_the_flag_is_named_in_the_summary(tiny, tmp_path, capsys):
    argv = pretrain_argv(tiny, tmp_path / "run", "--steps", "1", "--save-interval", "0",
                         "--model-overrides", "num_layers=1", "--peak-tflops", "0.5")
    summary = pretrain(load_config(argv)[0])
    out = capsys.readouterr().out
    assert summary["peak_tflops"] == 0.5 and summary["peak_source"] == "--peak-tflops"
    assert re.search(r"MFU measured against\s+0.5 TFLOP/s per device \(--peak-tflops\)", out)
    mfu = re.search(r"([\d.]+) TFLOP/s \| MFU ([\d.]+)%", out)
    assert float(mfu.group(2)) == pytest.approx(100 * float(mfu.group(1)) / 0.5, abs=0.2)


def test_resolve_peak():
    cpu = torch.device("cpu")
    assert resolve_peak("auto", cpu, None) == (None, "no known peak for cpu")
    assert resolve_peak("0", cpu, None) == (None, "no known peak for cpu")  # 0: the old "auto"
    assert resolve_peak("312", cpu, torch.bfloat16) == (312.0, "--peak-tflops")
    measured, source = resolve_peak("measure", cpu, None)
    assert measured > 0 and source.startswith("measured")
    for bad in ("fast", "-3"):
        with pytest.raises(ConfigError, match="--peak-tflops"):
            resolve_peak(bad, cpu, None)


@pytest.mark.parametrize(("name", "dtype", "tf32", "want"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4),
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.0),
    ("NVIDIA H100 80GB HBM3", None, False, 66.9),
    ("NVIDIA H100 80GB HBM3", None, True, 494.7),
    ("NVIDIA A100-SXM4-80GB", torch.float16, False, 312.0),
    ("NVIDIA L40S", torch.bfloat16, False, 362.0),
    ("NVIDIA L40", torch.bfloat16, False, None),  # not L4, not L40S
    ("NVIDIA A10G", torch.bfloat16, False, None),  # not A10
    ("NVIDIA GeForce RTX 3090", torch.bfloat16, False, None),
])
def test_known_peaks_match_whole_names(name, dtype, tf32, want):
    assert known_peak_tflops(name, dtype, tf32) == want


def test_cuda_peak_on_this_machine_when_there_is_one():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    peak, source = resolve_peak("auto", torch.device("cuda"), torch.bfloat16)
    name = torch.cuda.get_device_name()
    assert name in source and (peak is None) == (known_peak_tflops(name, torch.bfloat16) is None)
