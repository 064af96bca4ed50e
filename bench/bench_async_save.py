"""Checkpoint saves against the training step: how long a synchronous save and an asynchronous
one (`--async-save`) hold up the loop, on the same job, rows printed as they are measured.

One job (`training.loop.setup`, the path `tessera pretrain` runs) trains a small Llama; each
case saves a full training checkpoint (weights, AdamW moments, RNG; every file hashed) through
`CheckpointSaver` and then runs `--steps` more steps. Reported per case: the time the save call
blocked the loop, the mean step time over the steps taken while the checkpoint was being
written (the save's blocking time included), and that against the synchronous case (the ratio:
above 1, the asynchronous save let the steps go on). On a CPU the writer thread shares the cores
with the step, so the gain there is smaller than on a GPU, where the step runs on the device.

    python bench/bench_async_save.py [--hidden 256 --layers 4 --steps 8] [--budget-s S]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.core import ModelConfig  # noqa: E402
from tessera.training.checkpoint_saver import CheckpointSaver  # noqa: E402
from tessera.training.config import LoopConfig, PretrainConfig, TrainConfig  # noqa: E402
from tessera.training.loop import setup, train_step  # noqa: E402
from tessera.training.run_plan import resolve_plan  # noqa: E402


def build_job(args):
    config = ModelConfig.from_name(
        "llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
        ffn_hidden_size=int(args.hidden * 8 / 3) // 64 * 64, max_position_embeddings=args.seq)
    cfg = PretrainConfig(
        model=config,
        train=TrainConfig(global_batch=args.batch, seq_len=args.seq, precision="fp32",
                          device="cpu", steps=10**6, warmup_steps=0),
        loop=LoopConfig(progress=False, tensorboard=False))
    return setup(resolve_plan(cfg, 1), torch.device("cpu"))


def measure(job, run_dir: Path, asynchronous: bool, steps: int, batch) -> dict:
    """Save once, then train `steps` steps; the timings of that window."""
    saver = CheckpointSaver(run_dir, keep_last=1, asynchronous=asynchronous,
                            device=torch.device("cpu"))
    ids, labels = batch
    start = time.perf_counter()
    saver.save(job.stages, job.optimizer, step=len(list(run_dir.glob("*"))) + 1,
               consumed_samples=0, config={}, tokenizer=None)
    blocked = time.perf_counter() - start
    for i in range(steps):
        train_step(job, i, ids, labels)
    trained = time.perf_counter() - start
    reports = saver.finish() if asynchronous else []
    written = reports[0].written_s if reports else blocked
    return {"blocked_s": blocked, "written_s": written, "step_s": trained / steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps taken after each save")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no case starts once it is spent")
    args = parser.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("async_save")
    job = build_job(args)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = (ids, ids.clone())
    for i in range(2):  # warm-up; AdamW's moments exist from here on
        train_step(job, i, *batch)
    tic = time.perf_counter()
    for i in range(args.steps):
        train_step(job, i, *batch)
    plain = (time.perf_counter() - tic) / args.steps
    params = sum(p.numel() for m in job.stages for p in m.parameters())
    rows.add({"case": f"no save ({params / 1e6:.1f}M parameters)", "step_s": plain})
    sync_step = sync_blocked = None
    with tempfile.TemporaryDirectory() as tmp:
        for asynchronous in (False, True):
            name = "asynchronous save" if asynchronous else "synchronous save"
            if budget.skips(f"the {name}"):
                break
            got = measure(job, Path(tmp) / name.split()[0], asynchronous, args.steps, batch)
            sync_step = sync_step or got["step_s"]
            sync_blocked = sync_blocked or got["blocked_s"]
            rows.add({"case": name, "blocked_s": got["blocked_s"], "written_s": got["written_s"],
                      "step_s": got["step_s"], "sync / this step_s": sync_step / got["step_s"],
                      "sync / this blocked_s": sync_blocked / got["blocked_s"]})
    rows.finish()


if __name__ == "__main__":
    main()
