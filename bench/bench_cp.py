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

Dynamic against fixed cp (`--part dynamic`): micro-batches of one packed row of `--seq` tokens
whose documents have lengths drawn log-uniformly in `--doc-min .. --doc-max` (a target
workload's 64..8192 scaled by 1/4 to what two CPU cores run: 16..2048 in rows of 4096), documents isolated.
Fixed cp splits every row over all cp ranks; dynamic cp (`core.parallel.dynamic_cp_runtime`)
keeps short documents whole on one rank and spreads long ones over a sub-group. Fixed cp
runs one masked SDPA per rank over its chunks (masked-out pairs, across documents, are computed
too); dynamic cp runs each document kept whole on a rank through the causal kernel alone, and
one masked SDPA per stream spread over a sub-group.
The time of a micro-batch is the slowest rank's best of `--steps` forward + backward passes
(dynamic: its layout step included); the ratio is fixed / dynamic over all micro-batches.
"dynamic, masked whole docs" runs the documents kept whole on a rank as one masked attention
over their concatenation, as fixed cp runs its chunks: the gain without the per-document causal
kernel (placement, communication, and a rank's whole documents paired only with each other
rather than its chunks with the whole row).

Each row is printed as it is measured; `--budget-s` stops starting cp sizes once spent.

    python bench/bench_cp.py [--seq 4096 --layers 2 --hidden 256 --steps 2 --part all]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.config import Layout, TrainSchedule  # noqa: E402
from tessera.core.parallel.dynamic_cp_runtime import DynamicCP  # noqa: E402
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


def _best_time(model, step, steps: int) -> float:
    """The fastest of `steps` timed forward + backward passes of `step()` (after a warm-up the
    caller ran), every rank starting together."""
    best = float("inf")
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        tic = time.perf_counter()
        step().backward()
        best = min(best, time.perf_counter() - tic)
    return best


def _saved_bytes(model: torch.nn.Module, step) -> int:
    """Bytes of the distinct storages autograd saves for backward while `step()` runs its
    forward (parameters excluded); `step` must return the loss, whose backward is then run."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # The allgather exchange's functional collectives save their async wrapper, which has
        # no storage of its own: count the tensor it holds (waiting for it is harmless here).
        plain = t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t
        storage = plain.untyped_storage()
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
        out.append({"comm": comm, "saved": saved, "time": _best_time(model, step, args.steps)})
    return out


def measure(cp: int, comms: list[str], args) -> dict[str, dict]:
    """Per strategy: the largest saved bytes and the slowest best step time over the ranks."""
    per_rank = run_ranks(_body, cp, comms, args, timeout=600)
    return {comm: {"saved": max(r[i]["saved"] for r in per_rank),
                   "time": max(r[i]["time"] for r in per_rank)}
            for i, comm in enumerate(comms)}


def variable_batches(args) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`--batches` micro-batches (ids, labels, document ids), each one row of `--seq` tokens
    packed with documents of log-uniform lengths (the last one cut to fit), seeded."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.batches):
        docs, total, doc = [], 0, 0
        while total < args.seq:
            n = round(math.exp(rng.uniform(math.log(args.doc_min), math.log(args.doc_max))))
            n = min(n, args.seq - total)
            docs += [doc] * n
            total, doc = total + n, doc + 1
        tokens = torch.randint(0, VOCAB, (1, args.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:], torch.tensor([docs])))
    return out


def _packed_step(model, dynamic: DynamicCP | None, masked: bool, ids: torch.Tensor,
                 labels: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The loss of one packed micro-batch under fixed cp (`dynamic` None) or dynamic cp;
    `masked`: the documents kept whole on a rank run as one masked attention over their
    concatenation (as fixed cp runs its chunks) instead of one causal call each."""
    if dynamic is None:
        return model(ids, labels=labels, document_ids=docs)
    local_ids, local_labels, kw = dynamic.model_inputs(ids, labels, docs)
    if masked:
        kw = {"sequence": dataclasses.replace(kw["sequence"], documents=())}
    return model(local_ids, labels=local_labels, **kw)


MODES = ("fixed", "dynamic", "dynamic-masked")


def _dynamic_body(rank: int, world_size: int, args) -> dict[str, list[float]]:
    """Rank body: per mode (fixed, dynamic), this rank's best step time of each micro-batch."""
    torch.set_num_threads(1)
    config, layout = _config(args), Layout(cp=world_size)
    groups = init_groups(layout, kv_replicas=kv_replicas(config, 1))
    batches = variable_batches(args)
    out: dict[str, list[float]] = {}
    for mode in MODES:
        model = build_model(config, layout, groups, schedule=TrainSchedule(cp_comm=args.comm),
                            seed=0).train()
        dynamic = DynamicCP.create(config, layout, groups, args.comm) if mode != "fixed" else None
        times = []
        for ids, labels, docs in batches:
            step = functools.partial(_packed_step, model, dynamic, mode == "dynamic-masked",
                                     ids, labels, docs)
            step().backward()  # warm-up
            times.append(_best_time(model, step, args.steps))
        out[mode] = times
    return out


def measure_dynamic(args, isa: str, rows: Rows, budget: Budget) -> None:
    """One row per cp size: fixed and dynamic step times (slowest rank per micro-batch,
    summed over the micro-batches) and their ratio."""
    for i, cp in enumerate(args.dynamic_cp):
        if i and budget.skips(f"dynamic cp {cp} and later sizes"):
            break
        per_rank = run_ranks(_dynamic_body, cp, args, timeout=900)
        fixed, dynamic, masked = (
            sum(max(r[mode][b] for r in per_rank) for b in range(args.batches)) for mode in MODES)
        rows.add({"cp": cp, "cp_comm": args.comm, "seq": args.seq,
                  "doc lengths": f"log-uniform {args.doc_min}..{args.doc_max}",
                  "micro-batches": args.batches, "CPU ISA": isa,
                  "fixed s": fixed, "dynamic s": dynamic,
                  "speed-up (fixed / dynamic)": fixed / dynamic,
                  "dynamic, masked whole docs s": masked,
                  "speed-up (fixed / masked)": fixed / masked})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--part", choices=["all", "fixed", "dynamic"], default="all",
                        help="fixed: cp 1/2/4 memory and time; dynamic: dynamic vs fixed cp")
    parser.add_argument("--doc-min", type=int, default=16)
    parser.add_argument("--doc-max", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=3, help="dynamic: micro-batches")
    parser.add_argument("--dynamic-cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--comm", default="allgather", help="dynamic: cp_comm of both runs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no cp size starts once it is spent")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    os.environ.setdefault("TESSERA_FUSED_KERNELS", "off")  # no per-rank compiles
    isa = torch.backends.cpu.get_cpu_capability()
    # The machine may be shared: its load at the start says how far to trust the times.
    print(f"load average (1, 5, 15 min) at start: {os.getloadavg()}", flush=True)
    if args.part in ("all", "dynamic"):
        rows = Rows("cp_dynamic")
        measure_dynamic(args, isa, rows, budget)
        rows.finish()
    if args.part == "dynamic" or (args.part == "all" and budget.skips("the fixed cp part")):
        return
    rows = Rows("cp")
    base = measure(1, ["allgather"], args)["allgather"]  # cp 1: no communication
    rows.add({"cp": 1, "cp_comm": "-", "seq": args.seq, "CPU ISA": isa,
              "activations MiB/rank": base["saved"] / MIB,
              "ideal MiB (cp1/cp)": base["saved"] / MIB, "x ideal (mem)": 1.0,
              "step s": base["time"], "ideal s (cp1/cp)": base["time"], "x ideal (time)": 1.0})
    for cp in (2, 4):
        if budget.skips(f"cp {cp} and later sizes"):
            break
        for comm, r in measure(cp, ["allgather", "ring"], args).items():
            ideal_mem, ideal_time = base["saved"] / cp, base["time"] / cp
            rows.add({"cp": cp, "cp_comm": comm, "seq": args.seq, "CPU ISA": isa,
                      "activations MiB/rank": r["saved"] / MIB,
                      "ideal MiB (cp1/cp)": ideal_mem / MIB,
                      "x ideal (mem)": r["saved"] / ideal_mem, "step s": r["time"],
                      "ideal s (cp1/cp)": ideal_time, "x ideal (time)": r["time"] / ideal_time})
    rows.finish()


if __name__ == "__main__":
    main()
