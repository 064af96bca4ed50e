"""The start-of-run banner: what a run is about to do, printed once by global rank 0.

    tessera pretrain: llama-tiny, 2 layers, hidden 64, vocab 320: 131.90K parameters
      layout       tp 1 x pp 1 x dp 1 = 1 rank (sequence parallel off), 2 micro-batches
      batch        8 sequences x 32 tokens = 256 tokens/step; 3 steps = 768 tokens
      data         0.01 epochs of the training split of data/corpus (51,596 tokens in 588 documents)
      precision    fp32 on cpu
      MFU against  n/a (no known peak for cpu; pass --peak-tflops N, or --peak-tflops measure ...)
      logs         from global rank 0 of 1; the other ranks print only warnings and errors

It reads the config, the process groups and the training dataset; it computes nothing heavy.
"""

from __future__ import annotations

import math
from typing import Any

from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import num_parameters
from tessera.core.units import human_count
from tessera.training.metrics import describe_peak


def split_epochs(dataset: Any, seq_len: int) -> list[tuple[str, float, int, int]]:
    """(prefix, epochs, tokens, documents) of each dataset the training samples come from:
    epochs is the tokens the run reads (`seq_len` new ones per sample) over the split's."""
    parts = getattr(dataset, "datasets", None) or [dataset]
    out = []
    for part in parts:
        start, end = part.documents
        tokens = int(part.indexed.lengths[start:end].sum())
        epochs = part.num_samples * seq_len / tokens if tokens else math.inf
        out.append((part.indexed.prefix, epochs, tokens, end - start))
    return out


def run_banner(plan: Any, groups: ParallelGroups, train_ds: Any, device: Any, precision: str,
               peak: float | None, peak_source: str, *, verb: str = "pretrain",
               start_step: int = 0) -> str:
    """The banner's lines (see the module docstring) for a run of `plan`
    (`training.run_plan.RunPlan`)."""
    m, data, schedule = plan.model, plan.data, plan.schedule
    world = groups.tp_size * groups.cp_size * groups.pp_size * groups.dp_size
    name = m.name if getattr(m, "name", "") else "model"
    lines = [f"tessera {verb}: {name}, {m.num_layers} layers, hidden {m.hidden_size}, vocab "
             f"{m.vocab_size}: {human_count(num_parameters(m))} parameters"]
    cp = f" x cp {groups.cp_size} ({schedule.cp_comm})" if groups.cp_size > 1 else ""
    layout = (f"tp {groups.tp_size}{cp} x pp {groups.pp_size} x dp {groups.dp_size} = {world} "
              f"rank{'s' if world > 1 else ''} (sequence parallel "
              f"{'on' if plan.layout.sequence_parallel else 'off'})")
    if groups.pp_size > 1:
        layout += (f", schedule {schedule.schedule}, {plan.layout.virtual_stages} stage(s) "
                   "per rank")
    n_mb = schedule.micro_batches
    layout += f", {n_mb} micro-batch{'es' if n_mb > 1 else ''}"
    per_step = data.global_batch * data.seq_len
    steps = plan.run.steps - start_step
    batch = (f"{data.global_batch} sequences x {data.seq_len} tokens = {per_step:,} tokens/step; "
             f"{steps} step{'s' if steps != 1 else ''} = {steps * per_step:,} tokens")
    if start_step:
        batch += f" (resuming at step {start_step} of {plan.run.steps})"
    rows = [("layout", layout), ("batch", batch)]
    if train_ds is not None:
        data = [f"{e:.2f} epochs of the training split of {prefix} ({tok:,} tokens in "
                f"{docs:,} documents)" for prefix, e, tok, docs in split_epochs(train_ds, data.seq_len)]
        rows += [("data", d) for d in data]
    rows += [("precision", f"{precision} on {device}"),
             ("MFU against", describe_peak(peak, peak_source)),
             ("logs", f"from global rank 0 of {world}; the other ranks print only warnings "
                      "and errors")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(lines + [f"  {k:<{width}}  {v}" for k, v in rows])
