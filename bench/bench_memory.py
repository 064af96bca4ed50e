"""Memory per rank of the data-parallel flavours (ddp, zero1, fsdp) at dp 2 and 4, on gloo.

Each rank trains the same model for two AdamW steps and reports the bytes of the tensors it
holds, by kind: parameters, gradients (local shards under FSDP2) and optimizer state (moments +
step counts), plus its peak RSS. Next to them, the theory for the model's N parameters of 4 bytes:
ddp keeps 4N + 4N + 8N on every rank; zero1 divides the optimizer state by dp (4N + 4N + 8N/dp);
fsdp divides all three (16N/dp), plus what it gathers for a layer's forward and backward, which
is freed again and so shows only in the peak RSS. The RSS also holds torch itself (~300 MiB).

Each row is printed as it is measured; `--budget-s` stops starting runs once spent.

    python bench/bench_memory.py [--layers 4 --hidden 512 --vocab 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, peak_rss_mb  # noqa: E402

from tessera.core import Layout, ModelConfig, TrainSchedule, build_model  # noqa: E402
from tessera.core.parallel.data_parallel import (  # noqa: E402
    allreduce_gradients,
    build_zero_optimizer,
    wrap_data_parallel,
)
from tessera.core.parallel.groups import init_groups  # noqa: E402

MIB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _rank(rank: int, world: int, init: str, flavour: str, args, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    layout, schedule = Layout(dp=world), TrainSchedule(data_parallel=flavour)
    groups = init_groups(layout)
    config = ModelConfig.from_name("llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden,
                                   num_layers=args.layers, num_heads=args.hidden // 64,
                                   num_kv_heads=args.hidden // 64,
                                   ffn_hidden_size=args.hidden * 3, max_position_embeddings=64)
    model = wrap_data_parallel([build_model(config, layout, groups, seed=0)], schedule,
                               groups)[0]
    params = list(model.parameters())
    optimizer = (torch.optim.AdamW(params, lr=1e-4) if flavour == "ddp"
                 else build_zero_optimizer(params, groups, torch.optim.AdamW, lr=1e-4))
    ids = torch.randint(0, args.vocab, (2, 65), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        optimizer.zero_grad()
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        allreduce_gradients([model], groups)  # skips FSDP2's own (DTensor) gradients
        optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    report = {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
              "optimizer": _bytes(state), "rss": peak_rss_mb(),
              "n": sum(p.numel() for p in params)}
    if rank == 0:
        out.put(report)
    dist.destroy_process_group()


def measure(flavour: str, dp: int, args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(dp, f"file://{tmp}/rdzv", flavour, args, out),
                           nprocs=dp, start_method="spawn")
        return out.get(timeout=5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no run starts once it is spent")
    args = parser.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("bench_memory")
    os.environ.setdefault("TESSERA_FUSED_KERNELS", "off")
    isa = torch.backends.cpu.get_cpu_capability()
    for dp in (2, 4):
        for flavour in ("ddp", "zero1", "fsdp"):
            if rows.rows and budget.skips(f"{flavour} at dp {dp}"):
                continue
            r = measure(flavour, dp, args)
            n4 = 4 * r["n"]  # 4N bytes (a DTensor's numel is the whole parameter's)
            theory = {"ddp": (n4, n4, 2 * n4), "zero1": (n4, n4, 2 * n4 / dp),
                      "fsdp": (n4 / dp, n4 / dp, 2 * n4 / dp)}[flavour]
            held = r["params"] + r["grads"] + r["optimizer"]
            rows.add({
                "dp": dp, "flavour": flavour, "CPU ISA (torch kernels)": isa,
                "params MiB": r["params"] / MIB, "grads MiB": r["grads"] / MIB,
                "optimizer MiB": r["optimizer"] / MIB,
                "theory optimizer MiB (8N, or 8N/dp sharded)": theory[2] / MIB,
                "params+grads+optimizer MiB": held / MIB,
                "theory total MiB": sum(theory) / MIB,
                "peak RSS MiB (rank 0)": r["rss"],
            })
    rows.finish()


if __name__ == "__main__":
    main()
