"""Per-task validation of virtual prompts: answer loss and exact match by greedy generation.

- Answer loss: the mean cross-entropy over the answer tokens (and EOS), teacher-forced.
- Exact match: the answer generated greedily after the prompt, up to EOS, equals the reference
  (both stripped of surrounding whitespace). Without EOS in the targets (`--add-eos false`) the
  generation is cut at the reference's token count. With `--eval-engine` (one process, LoRA or
  full) the answers come from the engine `tessera serve` runs, handed down by the root command.

Generation recomputes the whole (short) sequence each step instead of keeping a KV cache, so
the same forward-only pass serves every layout: one process, tensor parallel, and pipeline
stages (`pipeline_forward`), whose last stage broadcasts each step's tokens to the others. Each
data-parallel rank takes every dp-th example; counts are summed over dp at the end.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.core.lora import lora_dropout_off, merge_lora_
from tessera.core.parallel.context_parallel import gather_sequence
from tessera.core.parallel.pipeline_forward import pipeline_forward
from tessera.core.parallel.sharding import last_stage_pp_rank
from tessera.tuning.data import Example, TaskData, make_batch, sequence

if TYPE_CHECKING:
    from tessera.tuning.loop import Tuning


def _amp(t: Tuning):
    job = t.job
    dtype = job.plan.precision.autocast_dtype
    return (torch.autocast(job.device.type, dtype=dtype) if dtype
            else contextlib.nullcontext())


def _logits(t: Tuning, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits `(B, T, V)` on the rank holding the last stage; None elsewhere. Under
    context parallelism each cp rank computes its tokens' logits and they are gathered."""
    job = t.job
    with _amp(t):
        if job.plan.layout.pp == 1:
            out = job.stages[0](ids).float()
        else:
            out = pipeline_forward(job.stages, job.groups, ids)
    if out is None:
        return None
    return gather_sequence(out.float(), 1, job.groups.cp_size, job.groups.cp_group)


def _from_last_stage(t: Tuning, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`value` (computed on the last stage's rank) on every rank of the pipeline group."""
    g = t.job.groups
    if g.pp_group is None:
        return value
    src = last_stage_pp_rank(t.job.plan.layout)
    buf = value.contiguous() if g.pp_rank == src else torch.empty_like(like)
    dist.broadcast(buf, src=g.pp_ranks[src], group=g.pp_group)
    return buf


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def answer_loss(t: Tuning, batch: list[Example]) -> tuple[float, int]:
    """Summed answer cross-entropy and the number of answer tokens of `batch`."""
    tokens, labels = make_batch(batch, t.task_index, t.n_virtual, t.seq_len, t.tokenizer.pad_id)
    tokens, labels = tokens.to(t.job.device), labels.to(t.job.device)
    logits = _logits(t, tokens)
    total = torch.zeros(2, device=t.job.device)
    if logits is not None:
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=-100, reduction="sum")
        total = torch.stack([losses, (labels != -100).sum().float()])
    total = _from_last_stage(t, total, total)
    return float(total[0]), int(total[1])


def generate_answers(t: Tuning, batch: list[Example]) -> list[list[int]]:
    """Greedy continuations of each example's virtual tokens + prompt (EOS cut off)."""
    eos = t.tokenizer.eos_id
    starts = [t.n_virtual[e.task] + len(e.prompt) for e in batch]
    max_new = max(len(e.answer) for e in batch)
    limit = t.job.stages[0].config.max_position_embeddings
    g = t.job.groups
    multiple = g.tp_size if g.cp_size == 1 else 2 * g.cp_size * g.tp_size  # cp: 2cp chunks
    width = min(_round_up(max(starts) + max_new, multiple), limit)
    ids = torch.full((len(batch), width), t.tokenizer.pad_id, dtype=torch.long)
    for row, e in enumerate(batch):
        prompt = sequence(e, t.task_index[e.task], t.n_virtual[e.task])[: starts[row]]
        ids[row, : starts[row]] = torch.tensor(prompt)
    ids = ids.to(t.job.device)
    lengths = torch.tensor(starts, device=t.job.device)
    rows = torch.arange(len(batch), device=t.job.device)
    for _ in range(max_new):
        logits = _logits(t, ids)
        nxt = torch.zeros(len(batch), dtype=torch.long, device=t.job.device)
        if logits is not None:
            nxt = logits[rows, lengths - 1].argmax(-1)
        nxt = _from_last_stage(t, nxt, nxt)
        active = lengths < width
        ids[rows[active], lengths[active]] = nxt[active]
        lengths = lengths + active.long()
    out = []
    for row, e in enumerate(batch):
        new = ids[row, starts[row]: int(lengths[row])].tolist()
        if eos is not None and eos in new:
            new = new[: new.index(eos)]
        elif not t.add_eos:
            new = new[: len(e.answer)]
        out.append(new)
    return out


@torch.no_grad()
def evaluate(t: Tuning, data: TaskData, max_batches: int = 0) -> dict[str, dict[str, Any]]:
    """`{task: {"loss", "accuracy", "examples"}}` over `data` (at most `max_batches` global
    batches per task; 0: all), the same on every rank. LoRA adapters run without dropout."""
    with lora_dropout_off(t.job.stages):
        return _evaluate(t, data, max_batches)


def _evaluate(t: Tuning, data: TaskData, max_batches: int) -> dict[str, dict[str, Any]]:
    g, device = t.job.groups, t.job.device
    per_dp = max(1, t.job.plan.data.per_dp_batch)
    results = {}
    for task, examples in data.by_task().items():
        if max_batches:
            examples = examples[: max_batches * per_dp * g.dp_size]
        mine = examples[g.dp_rank:: g.dp_size]
        engine = _engine_answers(t, mine) if t.engine_answers is not None else None
        counts = torch.zeros(4, dtype=torch.float64, device=device)  # loss, tokens, hits, n
        for i in range(0, len(mine), per_dp):
            batch = mine[i: i + per_dp]
            loss, n_tokens = answer_loss(t, batch)
            answers = engine[i: i + per_dp] if engine is not None else \
                generate_answers(t, batch)
            hits = sum(t.tokenizer.decode(a).strip() == e.answer_text.strip()
                       for a, e in zip(answers, batch))
            counts += torch.tensor([loss, n_tokens, hits, len(batch)], dtype=torch.float64,
                                   device=device)
        if g.dp_group is not None:
            dist.all_reduce(counts, group=g.dp_group)
        loss, n_tokens, hits, n = counts.tolist()
        results[task] = {"loss": loss / n_tokens if n_tokens else float("nan"),
                         "accuracy": hits / n if n else float("nan"), "examples": int(n)}
    return results


def _engine_answers(t: Tuning, examples: list[Example]) -> list[list[int]]:
    """Greedy answers through the serving engine (`--eval-engine`, one process): a copy of the
    model with its adapters merged, cut as `generate_answers` cuts them."""
    model = copy.deepcopy(t.job.stages[0])
    merge_lora_([model])
    answers = t.engine_answers(model.eval(), t.tokenizer, [e.prompt for e in examples],
                               [len(e.answer) for e in examples])
    if t.add_eos:
        return answers
    return [a[: len(e.answer)] for a, e in zip(answers, examples)]


def mean_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Example-weighted mean loss and accuracy over tasks."""
    n = sum(r["examples"] for r in results.values())
    if not n:
        return {"loss": float("nan"), "accuracy": float("nan")}
    return {key: sum(r[key] * r["examples"] for r in results.values()) / n
            for key in ("loss", "accuracy")}


def format_task_table(rows: list[dict[str, Any]]) -> str:
    """The end-of-run table: one line per task, before -> after where both exist."""
    def num(v: Any, pct: bool = False) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.4f}"

    def pair(before: Any, after: Any, pct: bool = False) -> str:
        return num(after, pct) if before is None else f"{num(before, pct)} -> {num(after, pct)}"

    header = ("task", "virtual", "train", "valid", "truncated", "answer loss", "exact match")
    lines = [header]
    for r in rows:
        lines.append((r["task"], str(r["n_virtual"]), str(r.get("train_examples", "-")),
                      str(r.get("valid_examples", "-")), str(r.get("truncated", 0)),
                      pair(r.get("loss_before"), r.get("loss")),
                      pair(r.get("accuracy_before"), r.get("accuracy"), pct=True)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)
