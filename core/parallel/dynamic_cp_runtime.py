"""Dynamic context parallelism at run time: lay out one micro-batch's sequences over the cp
group as `dynamic_cp.schedule` places them (`TrainSchedule.cp_dynamic`, `--cp-dynamic`).

A fixed cp splits every row of the micro-batch over the whole cp group. Here the micro-batch is
first cut into its sequences (the packed documents of every row when document ids are given,
else the rows), and each sequence goes to the aligned power-of-two block of ranks the scheduler
picks: short ones stay whole on one rank, long ones span 2, 4, ... ranks. The sequences placed
on one block are concatenated into one stream (each keeps its own document id, so nothing
attends across them, and positions restart per sequence), padded to a multiple of 2 * k
(padding: label -100, a document of its own), and split over the block's k ranks with the
load-balanced zigzag split. Sequences kept whole on one rank run through the causal attention
kernel one by one, so they cost what the scheduler counts (`LayerCost`: causal pairs within each
sequence); a stream spread over k ranks is one masked attention, as with fixed cp. A rank's
local row is the concatenation of its part of every block it belongs to, blocks in one global
order (larger blocks first, then by first rank): every rank of a block reaches that block's
collectives at the same point, so they never cross.

Every cp rank is given the whole micro-batch (as with fixed cp) and computes the same schedule.
Every token sits on exactly one rank, so the mean loss over the cp group's labelled tokens
(`context_parallel.global_mean_loss`, as for fixed cp) has exactly the one-process gradient once
the gradients are averaged over dp x cp.

The sub-groups (every aligned block of 2 .. cp/2 ranks of every cp group) are created up front
(`DynamicCP.create`): `new_group` is collective over the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.core.config import Layout, ModelConfig
from tessera.core.parallel.context_parallel import (
    SegmentedContext,
    SequenceContext,
    document_positions,
    zigzag_index,
)
from tessera.core.parallel.dynamic_cp import Assignment, LayerCost, Schedule, schedule
from tessera.core.parallel.groups import ParallelGroups, layout_mesh, new_groups

PAD_LABEL = -100


@dataclass(frozen=True)
class LocalBatch:
    """This rank's tokens of a micro-batch under dynamic cp: `ids`, `labels` `(1, T_local)` and
    the `SegmentedContext` to pass as the model's `sequence`; `schedule`: the placement."""

    ids: torch.Tensor
    labels: torch.Tensor
    context: SegmentedContext
    schedule: Schedule


def layout_problems(layout: Layout) -> list[str]:
    """What dynamic cp cannot run with (empty when it can), each with the fix."""
    out = []
    if layout.cp < 2 or layout.cp & (layout.cp - 1):
        out.append(f"cp_dynamic spreads sequences over power-of-two blocks of the cp group, "
                   f"but cp is {layout.cp}; use cp 2, 4, 8, ... or drop --cp-dynamic")
    if layout.pp > 1:
        out.append(f"cp_dynamic with pp {layout.pp}: a micro-batch's local length differs per "
                   "cp rank, which the pipeline schedules' fixed stage shapes cannot carry; use "
                   "pp 1 or fixed cp (drop --cp-dynamic)")
    if layout.sequence_parallel:
        out.append("cp_dynamic with sequence_parallel: a rank's local token count is not a "
                   "multiple of tp; drop --sequence-parallel or --cp-dynamic")
    return out


class DynamicCP:
    """The sub-groups of this rank's cp group and the per-micro-batch layout (`local_batch`)."""

    def __init__(self, groups: ParallelGroups, cost: LayerCost, comm: str,
                 blocks: dict[tuple[int, int], dist.ProcessGroup | None]) -> None:
        self.groups, self.cost, self.comm, self.blocks = groups, cost, comm, blocks

    @classmethod
    def create(cls, config: ModelConfig, layout: Layout, groups: ParallelGroups,
               comm: str = "allgather") -> DynamicCP:
        """Create every cp sub-group of the world (call on every rank, in the same order) and
        keep this rank's. The whole cp group serves blocks of cp ranks; blocks of 1 need none."""
        cp, mesh = layout.cp, layout_mesh(layout)
        mine: dict[tuple[int, int], dist.ProcessGroup | None] = {(cp, 0): groups.cp_group}
        k = 2
        while k < cp:  # the aligned blocks of k ranks of every cp group: cp split as (cp/k, k)
            blocks = mesh.regroup(["cp"], cp_block=cp // k, block=k)
            mine[(k, groups.cp_rank // k * k)] = new_groups(blocks.groups("block"))
            k *= 2
        cost = LayerCost.from_model(config.hidden_size, config.ffn_hidden_size,
                                    config.num_heads, config.num_kv_heads,
                                    gated_mlp=config.activation == "swiglu")
        return cls(groups, cost, comm, mine)

    def local_batch(self, ids: torch.Tensor, labels: torch.Tensor,
                    documents: torch.Tensor | None = None) -> LocalBatch:
        """This rank's tokens of the micro-batch `ids`, `labels` `(B, T)` (the same on every cp
        rank), cut into sequences at `documents` changes (per-token ids `(B, T)`) or by rows."""
        g = self.groups
        pieces = sequences(documents if documents is not None
                           else torch.zeros_like(ids))
        plan = schedule([n for _, _, n in pieces], g.cp_size, self.cost)
        by_block: dict[tuple[int, int], list[Assignment]] = {}
        for a in plan.assignments:
            by_block.setdefault((a.ranks, a.first), []).append(a)
        local_ids, local_labels, local_pos, segments, starts, whole = [], [], [], [], [], []
        offset = 0
        for (k, first), members in sorted(by_block.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
            if not first <= g.cp_rank < first + k:
                continue
            seg_ids, seg_labels, seg_docs = _stream(ids, labels, pieces, members, k)
            index = (zigzag_index(seg_ids.numel(), k, g.cp_rank - first, ids.device) if k > 1
                     else torch.arange(seg_ids.numel(), device=ids.device))
            ctx = SequenceContext(seg_ids.numel(), index, k, g.cp_rank - first,
                                  self.blocks.get((k, first)) if k > 1 else None,
                                  tuple(g.cp_ranks[first:first + k]), self.comm,
                                  seg_docs[None])
            local_ids.append(seg_ids[index])
            local_labels.append(seg_labels[index])
            local_pos.append(document_positions(seg_docs[None])[0, index])
            segments.append(ctx)
            whole.append(tuple(pieces[a.index][2] for a in members) if k == 1 else None)
            starts.append(offset)
            offset += index.numel()
        empty = ids.new_zeros(0)
        cat = (lambda xs: torch.cat(xs)[None] if xs else empty[None])  # noqa: E731
        context = SegmentedContext(tuple(segments), tuple(starts), cat(local_pos), g.cp_size,
                                   g.cp_group, tuple(whole))
        return LocalBatch(cat(local_ids), cat(local_labels), context, plan)


    def model_inputs(self, ids: torch.Tensor, labels: torch.Tensor,
                     documents: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, SegmentedContext]]:
        """`local_batch` as the model takes it: (ids, labels, keyword arguments)."""
        local = self.local_batch(ids, labels, documents)
        return local.ids, local.labels, {"sequence": local.context}


def sequences(documents: torch.Tensor) -> list[tuple[int, int, int]]:
    """The sequences of a micro-batch as (row, start, length), row by row: runs of equal
    document id `(B, T)` (a row's edge ends a sequence too)."""
    out = []
    for row, docs in enumerate(documents.tolist()):
        start = 0
        for t in range(1, len(docs) + 1):
            if t == len(docs) or docs[t] != docs[t - 1]:
                out.append((row, start, t - start))
                start = t
    return out


def _stream(ids: torch.Tensor, labels: torch.Tensor, pieces: list[tuple[int, int, int]],
            members: list[Assignment], k: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's sequences concatenated (ids, labels, document ids 0, 1, ...), padded to a
    multiple of 2k when k > 1 with ignored tokens in a document of their own."""
    parts_ids, parts_labels, parts_docs = [], [], []
    for doc, a in enumerate(members):
        row, start, n = pieces[a.index]
        parts_ids.append(ids[row, start:start + n])
        parts_labels.append(labels[row, start:start + n])
        parts_docs.append(torch.full((n,), doc, dtype=torch.long, device=ids.device))
    total = sum(p.numel() for p in parts_ids)
    pad = (-total) % (2 * k) if k > 1 else 0
    if pad:
        parts_ids.append(ids.new_zeros(pad))
        parts_labels.append(labels.new_full((pad,), PAD_LABEL))
        parts_docs.append(torch.full((pad,), len(members), dtype=torch.long, device=ids.device))
    return torch.cat(parts_ids), torch.cat(parts_labels), torch.cat(parts_docs)
