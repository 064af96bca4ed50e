"""Context parallelism on gloo: activation memory per rank and step time of one forward + backward
of a small Llama over one long sequence, for cp 1, 2 and 4 and both K/V strategies (allgather,
ring), next to the ideal (the cp 1 figure divided by cp), measured in the same run.

Activation memory is measured with torch's saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`): the bytes of every distinct storage autograd saves
for backward during the forward, parameters excluded. That is the activation memory a rank holds
at the end of its forward, its peak for one micro-batch; transient buffers freed within the
forward (the scores of a ring block, gloo's send/receive buffers) are not in it. The step time is
the best of `--steps` timed forward + backward passes after one warm-up, the slowest rank's. Every
rank runs on one thread; with more ranks than cores the ranks share cores, which makes the cp 4
times pessimistic; the load average at the start is printed, as the machine may be shared.

    python bench/bench_cp.py [--seq 4096 --layers 2 --hidden 256 --steps 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import record  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.config import Layout, TrainSchedule  # noqa: E402
from tessera.core.parallel.groups import init_groups  # noqa: E402
from tessera.core.parallel.sharding import kv_replicas  # noqa: E402
from tessera.core.parallel.spawn import run_ranks  # noqa: E402

MIB = 2**20
VOCAB = 4096


def _config(args) -> ModelConfig:
    return ModelConfig.from_name("llama-tiny", vocab_size=VOCAB, hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=args.hidden // 64,
                                 num_kv_heads=max(1, args.hidden // 128),
                                 ffn_hidden_size=args.hidden * 3,
                                 max_position_embeddings=args.seq)


def _saved_bytes(model: torch.nn.Module, step) -> int:
    """Bytes of the distinct storages autograd saves for backward while `step()` runs its
    forward (parameters excluded); `step` must return the loss, whose backward is then run."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    total = sum(seen.values())
    loss.backward()
    return total


def _body(rank: int, world_size: int, comms: list[str], args) -> list[dict]:
    """Rank body: for each cp strategy, the saved bytes and the best step time on this rank."""
    torch.set_num_threads(1)
    config = _config(args)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, args.seq + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    out = []
    for comm in comms:
        layout = Layout(cp=world_size)
        groups = init_groups(layout, kv_replicas=kv_replicas(config, 1))
        model = build_model(config, layout, groups, schedule=TrainSchedule(cp_comm=comm),
                            seed=0).train()
        step = functools.partial(model, ids, labels=labels)
        saved = _saved_bytes(model, step)  # also the warm-up
        best = float("inf")
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            tic = time.perf_counter()
            step().backward()
            best = min(best, time.perf_counter() - tic)
        out.append({"comm": comm, "saved": saved, "time": best})
    return out


def measure(cp: int, comms: list[str], args) -> dict[str, dict]:
    """Per strategy: the largest saved bytes and the slowest best step time over the ranks."""
    per_rank = run_ranks(_body, cp, comms, args, timeout=600)
    return {comm: {"saved": max(r[i]["saved"] for r in per_rank),
                   "time": max(r[i]["time"] for r in per_rank)}
            for i, comm in enumerate(comms)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("TESSERA_FUSED_KERNELS", "off")  # no per-rank compiles
    isa = torch.backends.cpu.get_cpu_capability()
    # The machine may be shared: its load at the start says how far to trust the times.
    print(f"load average (1, 5, 15 min) at start: {os.getloadavg()}", flush=True)
    base = measure(1, ["allgather"], args)["allgather"]  # cp 1: no communication
    rows = [{"cp": 1, "cp_comm": "-", "seq": args.seq, "CPU ISA": isa,
             "activations MiB/rank": base["saved"] / MIB, "ideal MiB (cp1/cp)": base["saved"] / MIB,
             "x ideal (mem)": 1.0, "step s": base["time"], "ideal s (cp1/cp)": base["time"],
             "x ideal (time)": 1.0}]
    print(rows[-1], flush=True)
    for cp in (2, 4):
        for comm, r in measure(cp, ["allgather", "ring"], args).items():
            ideal_mem, ideal_time = base["saved"] / cp, base["time"] / cp
            rows.append({"cp": cp, "cp_comm": comm, "seq": args.seq, "CPU ISA": isa,
                         "activations MiB/rank": r["saved"] / MIB,
                         "ideal MiB (cp1/cp)": ideal_mem / MIB,
                         "x ideal (mem)": r["saved"] / ideal_mem, "step s": r["time"],
                         "ideal s (cp1/cp)": ideal_time, "x ideal (time)": r["time"] / ideal_time})
            print(rows[-1], flush=True)
    record(rows, "cp")


if __name__ == "__main__":
    main()
