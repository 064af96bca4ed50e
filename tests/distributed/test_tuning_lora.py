"""LoRA tuning on gloo ranks: tp2 x pp2, tp2 x dp2 (sequence parallel), cp2 x dp2 (ring) and tp4
(kv heads replicated over tp ranks, so B's kv rows too) give the single-process run's losses (8 steps,
1e-5 relative) and adapter (and, in the slow tp4 case, validation metrics); the base stays
bit-identical on every rank; only A/B get gradients, the replicated factor's identical over tp,
every one identical over dp and cp; and `--merge` written by tp2 x pp2 ranks equals base + adapter.

One spawn of 4 ranks runs the default layouts in turn (a second, slow, runs tp4); the
reference runs here, in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.core.checkpoint import CheckpointReader, load_checkpoint
from tessera.core.lora import is_lora_parameter
from tessera.core.lora_format import load_adapter
from tessera.core.parallel.sharding import shard_spec
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tessera.tuning.lora_merge import merge_adapter
from tests.distributed_helper import run_ranks
from tests.unit.tuning.tuning_helper import random_base_and_tasks, tune_argv

LAYOUTS = {
    "tp2pp2": ("--tp", "2", "--pp", "2", "--micro-batches", "2"),
    "tp2dp2": ("--tp", "2", "--dp", "2", "--sequence-parallel", "true"),
    "cp2dp2-ring": ("--cp", "2", "--dp", "2", "--cp-comm", "ring"),
}
SLOW_LAYOUTS = {"tp4": ("--tp", "4")}  # llama-tiny's 2 kv heads, each replicated on 2 tp ranks
RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict[str, Path]:
    """A random-weight tiny Llama with a tokenizer, and two tasks' train/valid files."""
    return random_base_and_tasks(tmp_path_factory.mktemp("tuning-lora"))


def _argv(s: dict[str, Path], out: Path, *extra: str, valid: bool = True) -> list[str]:
    """Flags of an 8-step LoRA run; without `valid` no validation (generation is the slow part
    under a pipeline)."""
    return tune_argv(s["base"], out, s["train"], s["valid"] if valid else None, "--steps", "8",
                     "--global-batch",
                     "8", "--micro-batches", "2", "--method", "lora", "--lora-rank", "4",
                     "--lora-alpha", "8", "--lora-targets", "all", "--lr", "1e-2", *extra)


def _check_steps(argv: list[str], base: str) -> None:
    """Two steps under this layout: gradients only on A/B, the tp-replicated factor's equal over
    tp, all equal over dp; the base bit-identical to the checkpoint on every rank."""
    cfg, _ = load_config(argv)
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    g = t.job.groups
    reader = CheckpointReader(base)
    for step in range(2):
        tokens, labels = train_batch(t, inputs.train, step)
        train_step(t.job, step, tokens, labels)
    for stage in t.job.stages:
        for name, p in stage.named_parameters():
            if not is_lora_parameter(name):
                assert p.grad is None, name
                expected = reader.shard(stage.global_name(name), g.tp_rank, g.tp_size)
                assert torch.equal(p, expected), name
                continue
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            replicated = shard_spec(name, stage.config).dim is None
            for group, size, same in ((g.tp_group, g.tp_size, replicated),
                                      (g.dp_group, g.dp_size, True),
                                      (g.cp_group, g.cp_size, True)):
                if group is None:
                    continue
                copies = [torch.empty_like(p.grad) for _ in range(size)]
                dist.all_gather(copies, p.grad.contiguous(), group=group)
                if same:
                    for c in copies:
                        torch.testing.assert_close(c, p.grad, rtol=0, atol=1e-7)


def _rank_body(rank: int, world_size: int, jobs: dict[str, list[str]], base: str,
               merged: str | None) -> dict:
    out = {}
    for name, argv in jobs.items():
        _check_steps(argv, base)
        cfg = load_config(argv)[0]
        summary = tune(cfg)
        out[name] = {"losses": summary["losses"], "after": summary["after"]}
    if merged is None:
        return out
    # Merge the tp2 x pp2 run's adapter, written by tp2 x pp2 ranks.
    cfg, _ = load_config(["--checkpoint", base, "--output", merged, "--tp", "2", "--pp", "2",
                          "--device", "cpu"])
    merge_adapter(cfg, str(Path(jobs["tp2pp2"][jobs["tp2pp2"].index("--output") + 1])
                           / "adapter"))
    return out


@pytest.fixture(scope="module")
def reference(setting) -> dict:
    return tune(load_config(_argv(setting, setting["root"] / "single"))[0])


def _check_results(setting: dict, reference: dict, layouts: dict, results: list[dict]) -> None:
    root = setting["root"]
    _, want = load_adapter(root / "single" / "adapter")
    for name in layouts:
        for rank_result in results:
            got = rank_result[name]
            worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"]))
            assert worst <= RTOL, (name, worst, got["losses"], reference["losses"])
            for task, metrics in (reference["after"] if got["after"] else {}).items():
                assert got["after"][task]["accuracy"] == metrics["accuracy"], name
                assert abs(got["after"][task]["loss"] - metrics["loss"]) <= 1e-4 * metrics["loss"]
        state = root / name / "checkpoints" / "step-00000008" / "state.json"
        assert json.loads(state.read_text())["lora"]["modules"][0] == "layers.0.attention.wqkv"
        _, adapter = load_adapter(root / name / "adapter")
        assert adapter.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(adapter[key], want[key], rtol=1e-4, atol=1e-5)


def test_layouts_match_one_process_and_keep_the_base(setting, reference):
    root = setting["root"]
    jobs = {name: _argv(setting, root / name, *flags, valid=False)
            for name, flags in LAYOUTS.items()}
    results = run_ranks(_rank_body, 4, jobs, str(setting["base"]), str(root / "merged"),
                        timeout=600)
    _check_results(setting, reference, LAYOUTS, results)
    merged = load_checkpoint(root / "merged")
    manifest = CheckpointReader(root / "merged").manifest
    assert (manifest.layout.tp, manifest.layout.pp) == (2, 2)
    from tessera.core.lora import attach_lora

    config, tensors = load_adapter(root / "tp2pp2" / "adapter")
    plain = load_checkpoint(setting["base"])
    attach_lora([plain], config, tensors=tensors)
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), plain(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_replicated_kv_heads_match_one_process(setting, reference):
    root = setting["root"]
    jobs = {name: _argv(setting, root / name, *flags) for name, flags in SLOW_LAYOUTS.items()}
    results = run_ranks(_rank_body, 4, jobs, str(setting["base"]), None, timeout=600)
    _check_results(setting, reference, SLOW_LAYOUTS, results)
