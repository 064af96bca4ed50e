"""Prompt tuning with ZeRO-1 and FSDP2 on 2 gloo ranks (dp2): the losses and prompt table of ddp,
moments saved as each dp rank's rows, a bit-exact resume on the same layout, and resumes across
flavours and into one process from the same moments.

One spawn runs every job; rank 0 copies a run's step-4 checkpoint for the resumed jobs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from tessera.core import ModelConfig, build_model, save_checkpoint
from tessera.core.prompt_table import read_prompt_table
from tessera.core.tokenizer import train_tokenizer
from tessera.tuning.checkpoint import STATE_FILE, read_tuning_meta
from tessera.tuning.config import load_config
from tessera.tuning.loop import tune
from tests.distributed_helper import run_ranks
from tests.unit.tuning.tuning_helper import corpus, task_examples, tune_argv, write_jsonl

SAME = 1e-6
FLAVOURS = ("ddp", "zero1", "fsdp")
RESUMED = {"zero1-from-zero1": ("zero1", "zero1"), "fsdp-from-fsdp": ("fsdp", "fsdp"),
           "fsdp-from-zero1": ("fsdp", "zero1"), "ddp-from-fsdp": ("ddp", "fsdp")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tuning-sharded")
    tok = root / "tok.model"
    train_tokenizer([], 384, tok, "bpe", texts=corpus(300), num_threads=1)
    config = ModelConfig.from_name("llama-tiny", vocab_size=384, num_layers=2,
                                   max_position_embeddings=64)
    base = save_checkpoint(root / "base", build_model(config, seed=5), tokenizer=tok)
    train = task_examples("kind", "train", 32) + task_examples("count", "train", 32)
    return {"root": root, "base": base, "train": write_jsonl(root / "train.jsonl", train)}


def _argv(s: dict[str, Path], out: Path, flavour: str, *extra: str) -> list[str]:
    # p-tuning: an MLP encoder whose weights (dims 32..) split into uneven dp rows too
    return tune_argv(s["base"], out, s["train"], None, "--steps", "8", "--global-batch", "8",
                     "--micro-batches", "2", "--virtual-tokens", "3", "--method", "p-tuning",
                     "--save-interval", "4", "--keep-last", "5", "--dp", "2",
                     "--data-parallel", flavour, *extra)


def _body(rank: int, world_size: int, jobs: list[tuple]) -> dict[str, list[float]]:
    losses = {}
    for name, argv, source in jobs:
        if source is not None:
            if rank == 0:  # the run as it was after its step-4 checkpoint
                step4 = Path(source) / "checkpoints" / "step-00000004"
                shutil.copytree(step4, Path(argv[argv.index("--output") + 1]) / "checkpoints"
                                / step4.name)
            dist.barrier()
        losses[name] = tune(load_config(argv)[0])["losses"]
    return losses


@pytest.fixture(scope="module")
def runs(setting) -> dict[str, tuple[Path, list[float]]]:
    root = setting["root"]
    jobs = [(f, _argv(setting, root / f, f), None) for f in FLAVOURS]
    for name, (flavour, source) in RESUMED.items():
        jobs.append((name, _argv(setting, root / name, flavour, "--resume"), str(root / source)))
    losses = run_ranks(_body, 2, jobs, timeout=900)[0]
    return {name: (root / name, losses[name]) for name in losses}


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("flavour", ["zero1", "fsdp"])
def test_sharded_tuning_follows_ddp_and_saves_rows(runs, flavour):
    run, losses = runs[flavour]
    assert _worst(losses, runs["ddp"][1]) <= SAME
    _, got = read_prompt_table(run)
    _, want = read_prompt_table(runs["ddp"][0])
    for task in want:
        torch.testing.assert_close(got[task], want[task], rtol=1e-5, atol=1e-6)
    step = run / "checkpoints" / "step-00000008"
    assert read_tuning_meta(step)["optimizer"] == {"format": 2, "dp_files": 2}
    with safe_open(str(step / STATE_FILE), framework="pt") as f:
        assert not any(k.startswith("exp_avg") for k in f.keys())  # moments are in the rows
    for d in (0, 1):
        with safe_open(str(step / f"prompt_optim-dp{d:02d}.safetensors"), framework="pt") as f:
            assert any(k.startswith("exp_avg_sq/") for k in f.keys())


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resumed_tuning_continues_the_run_it_came_from(runs, name):
    flavour, source = RESUMED[name]
    got, want = runs[name][1], runs[source][1][4:]
    if flavour == source:
        assert got == want  # bit-exact on the same layout
        _, a = read_prompt_table(runs[name][0])
        _, b = read_prompt_table(runs[source][0])
        assert all(torch.equal(a[task], b[task]) for task in a)
    else:
        assert _worst(got, want) <= SAME


def test_one_process_resumes_a_sharded_tuning_checkpoint(runs, setting, tmp_path):
    part = tmp_path / "part"
    step4 = runs["zero1"][0] / "checkpoints" / "step-00000004"
    shutil.copytree(step4, part / "checkpoints" / step4.name)
    argv = _argv(setting, part, "ddp", "--resume")
    argv[argv.index("--dp") + 1] = "1"
    losses = tune(load_config(argv)[0])["losses"]
    # one process sums the micro-batches of both dp ranks: the same moments, other rounding
    assert _worst(losses, runs["zero1"][1][4:]) <= 1e-5
