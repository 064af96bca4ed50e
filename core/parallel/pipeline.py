"""Pipeline parallelism over `torch.distributed.pipelining`: stages, schedules by name, the
checks of a training schedule against a layout, and the gradient syncs that a pipelined step
needs around them.

Each pipeline rank holds one or more stages (model chunks, the model family's stage modules,
`core.models.family.Family.stage`), placed by the `Layout`
(`sharding.stage_ids`): one for 1F1B/GPipe, `virtual_stages` for the looped schedules (rank r
holds stages r, r + pp, ...), and two in a V for ZBV/DualPipeV (placement `v`: rank r holds
stages r and 2pp - 1 - r, so rank 0 holds the first and the last). `build_stages` returns those
modules; they are what optimizers, checkpoints and data parallelism see, with unchanged
parameter names. `build_schedule` wraps them in `PipelineStage`s and the schedule class named by
`TrainSchedule.schedule`, and `pipeline_step` runs one training step through it.
`train_schedule_problems` / `validate_training` check a `TrainSchedule` against a `Layout`
(the schedule names live here, so `core.config` does not import this module).

The last stage returns its tensor-parallel shard of the logits (`local_logits=True`, passed
by `pipeline_step` as a keyword the schedule hands to every local stage) and the schedule's loss
function (`pipeline_loss_fn`) takes the vocabulary-parallel cross-entropy of it, so the logits
are never gathered over tp. The schedule divides gradients by the number of micro-batches
(`scale_grads=True`), so the loss function returns each micro-batch's mean.

After the step, and before the optimizer, call `sync_tied_embedding_grads` (tied embeddings
split over stages), `sync_sequence_parallel_grads` (under sequence parallelism),
`sync_kv_replica_grads` (kv heads replicated over tp ranks) and, with data parallelism,
`data_parallel.allreduce_gradients`.

`torch.distributed.pipelining` is imported lazily: it costs over a second, and config
validation imports this module for the schedule names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.config import (
    ConfigError,
    Layout,
    ModelConfig,
    Placement,
    TrainSchedule,
    divisors,
)
from tessera.core.parallel.expert_data_parallel import expert_schedule_problems
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import last_stage_pp_rank, stage_ids

# name -> torch.distributed.pipelining schedule class name
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Schedules that run on the V placement (`Layout.placement == "v"`: rank r holds stages r and
# 2pp - 1 - r); all others run on the looped placement.
V_SCHEDULES = frozenset({"zbv", "dualpipev"})
# Schedules that split backward into an input pass and a later weight pass (zero bubble).
SPLIT_BACKWARD_SCHEDULES = frozenset({"zero-bubble", "zbv", "dualpipev"})
# Schedules that take one stage per rank (the others take the list of local stages).
_SINGLE_STAGE = frozenset({"gpipe", "1f1b"})

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Builds one stage: `build(config, layout, groups, schedule=, stage_id=, num_stages=, device=,
# dtype=, seed=, init=, backend=)`, as `core.init.build_model` does for any family.
StageBuilder = Callable[..., nn.Module]
DATA_PARALLEL = ("ddp", "fsdp", "zero1")
_LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))
_SCHEDULE_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainSchedule))


def default_placement(schedule: str) -> Placement:
    """The stage placement `schedule` runs on: `v` for ZBV and DualPipeV, else `looped`."""
    return "v" if schedule in V_SCHEDULES else "looped"


def split_layout_and_schedule(fields: Mapping[str, Any]) -> tuple[Layout, TrainSchedule]:
    """A `Layout` and a `TrainSchedule` from one flat mapping of both's fields (the `parallel:`
    section of the pretraining and tuning configs). Without a `placement`, the layout takes
    the one the schedule needs (`default_placement`)."""
    unknown = sorted(set(fields) - _LAYOUT_FIELDS - _SCHEDULE_FIELDS)
    if unknown:
        raise ConfigError(f"unknown layout or schedule fields {unknown}; known fields: "
                          f"{sorted(_LAYOUT_FIELDS | _SCHEDULE_FIELDS)}")
    schedule = TrainSchedule(**{k: v for k, v in fields.items() if k in _SCHEDULE_FIELDS})
    lay = {k: v for k, v in fields.items() if k in _LAYOUT_FIELDS}
    lay.setdefault("placement", default_placement(schedule.schedule))
    return Layout(**lay), schedule


def _placement_problems(layout: Layout, schedule: TrainSchedule) -> list[str]:
    """Whether the schedule `schedule.schedule` can run on the layout's stage placement."""
    name = schedule.schedule
    if name not in SCHEDULES:
        return [f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}"]
    if name in V_SCHEDULES:
        out = [] if layout.virtual_stages == 2 else [
            f"schedule {name!r} places two stages per rank: set virtual_stages 2"]
        if layout.placement != "v":
            out.append(f"schedule {name!r} runs stages placed in a V: set placement 'v' "
                       f"(got {layout.placement!r})")
        return out
    if layout.placement != "looped":
        return [f"schedule {name!r} runs looped stage placement, but placement is "
                f"{layout.placement!r}; use 'zbv' or 'dualpipev', or placement 'looped'"]
    if layout.virtual_stages > 1 and name in _SINGLE_STAGE:
        return [f"schedule {name!r} runs one stage per rank but virtual_stages is "
                f"{layout.virtual_stages}; use 'interleaved-1f1b' or set virtual_stages 1"]
    return []


def schedule_problems(layout: Layout, schedule: TrainSchedule) -> list[str]:
    """What the pipeline schedule cannot do with this layout (empty when it can run)."""
    name, n_mb, pp = schedule.schedule, schedule.micro_batches, layout.pp
    stages = layout.num_stages
    out = _placement_problems(layout, schedule)
    if pp < 2:
        out.append(f"pipeline schedules need pp >= 2 (got pp {pp}); with pp 1 call the model "
                   "directly and accumulate gradients over micro-batches")
    if n_mb < 1:
        return out + [f"micro_batches must be >= 1, got {n_mb}"]
    if name == "1f1b" and n_mb < stages:
        out.append(f"schedule '1f1b' needs micro_batches >= stages: got {n_mb} micro-batches "
                   f"for {stages} stages")
    if name == "dualpipev" and n_mb < stages:
        out.append(f"schedule 'dualpipev' needs micro_batches >= stages (pp {pp} x 2 = "
                   f"{stages}): got {n_mb}; raise micro_batches or use 'zbv'")
    if name in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, n_mb // max(pp, 1))
        if n_mb % rounds:
            out.append(f"schedule {name!r} runs micro-batches in rounds of pp {pp}: "
                       f"micro_batches {n_mb} must be a multiple of {rounds} (e.g. "
                       f"{rounds * pp})")
    return out


def train_schedule_problems(
    layout: Layout, schedule: TrainSchedule, global_batch: int | None = None
) -> list[str]:
    """Every reason `schedule` cannot train on `layout` (empty when it can), at any pp: the
    pipeline schedule's own limits (`schedule_problems`) when pp > 1, recomputation, the
    data-parallel flavour, and the split of `global_batch` over dp and micro-batches."""
    if min(layout.tp, layout.pp, layout.virtual_stages, layout.dp) < 1:
        return []  # `Layout.problems` names these; nothing below can be computed
    out: list[str] = []
    if schedule.micro_batches < 1:
        out.append(f"micro_batches must be >= 1, got {schedule.micro_batches}")
    if layout.pp > 1:
        out += [p for p in schedule_problems(layout, schedule) if p not in out]
    else:
        out += _placement_problems(layout, schedule)
    if schedule.recompute not in ("none", "selective", "full"):
        out.append(f"unknown recompute {schedule.recompute!r}; choose none, selective or full")
    if (schedule.recompute == "full" and schedule.recompute_layers is not None
            and schedule.recompute_layers < 0):
        out.append(f"recompute_layers must be >= 0, got {schedule.recompute_layers}")
    if schedule.data_parallel not in DATA_PARALLEL:
        out.append(f"unknown data_parallel {schedule.data_parallel!r}; choose one of "
                   f"{list(DATA_PARALLEL)}")
    out += expert_schedule_problems(layout, schedule)  # expert parallelism
    if global_batch is not None and schedule.micro_batches >= 1:
        per_dp = global_batch // layout.dp
        if global_batch % layout.dp:
            out.append(f"global batch {global_batch} is not divisible by dp {layout.dp}")
        elif per_dp % schedule.micro_batches:
            out.append(
                f"per-data-parallel batch {per_dp} (global {global_batch} / dp {layout.dp}) "
                f"does not split into {schedule.micro_batches} micro-batches; choose "
                f"micro_batches in {divisors(per_dp)}")
    return out


def context_parallel_problems(
    model: ModelConfig, layout: Layout, schedule: TrainSchedule
) -> list[str]:
    """What context parallelism cannot (yet) do with this model and schedule (empty when it can,
    and always when cp is 1, except for an unknown `cp_comm`)."""
    from tessera.core.config import CP_COMMS

    out: list[str] = []
    if schedule.cp_comm not in CP_COMMS:
        out.append(f"unknown cp_comm {schedule.cp_comm!r}; choose one of {list(CP_COMMS)}")
    if schedule.cp_dynamic and model.sliding_window is not None:
        out.append(f"dynamic cp runs full causal attention, but the model has sliding_window="
                   f"{model.sliding_window}; use a fixed cp (cp_dynamic off)")
    if layout.cp <= 1:
        return out + _dynamic_cp_problems(layout, schedule)
    if layout.pp > 1 and schedule.schedule in SPLIT_BACKWARD_SCHEDULES:
        out.append(f"cp {layout.cp} with schedule {schedule.schedule!r}: the split-backward "
                   "(zero-bubble) schedules are not checked with context parallelism yet; use "
                   "'1f1b', 'interleaved-1f1b' or 'gpipe', or cp 1")
    return out + _dynamic_cp_problems(layout, schedule)


def _dynamic_cp_problems(layout: Layout, schedule: TrainSchedule) -> list[str]:
    if not schedule.cp_dynamic:
        return []
    from tessera.core.parallel.dynamic_cp_runtime import layout_problems

    return layout_problems(layout)


def validate_training(
    model: ModelConfig,
    layout: Layout,
    schedule: TrainSchedule,
    *,
    world_size: int | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Raise one `ConfigError` listing every problem of the layout (`Layout.problems`) and of
    the schedule on it (`train_schedule_problems`), each with the numbers and the fix."""
    problems = layout.problems(model, world_size, seq_len)
    problems += train_schedule_problems(layout, schedule, global_batch)
    problems += context_parallel_problems(model, layout, schedule)
    if problems:
        raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(problems))


def build_stages(
    config: ModelConfig,
    layout: Layout,
    groups: ParallelGroups,
    *,
    schedule: TrainSchedule | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init: bool = True,
    backend: str = "auto",
    build: StageBuilder | None = None,
) -> list[nn.Module]:
    """This rank's model chunks, one per local pipeline stage, in execution order
    (`sharding.stage_ids` of the layout's placement), each made by `build` (default:
    `core.init.build_model`, which builds the config's family's stage); `backend` as
    `build_model`'s.

    `schedule` gives the chunks their recomputation (None: none; inference needs no schedule).
    Initialization is layout-independent (`core.init`): every chunk equals the matching slice
    of the single-process model built with the same `seed`.
    """
    if build is None:
        from tessera.core.init import build_model as build

    layout.validate(config)
    return [
        build(config, layout, groups, schedule=schedule, stage_id=s,
                    num_stages=layout.num_stages, device=device, dtype=dtype, seed=seed,
                    init=init, backend=backend)
        for s in stage_ids(layout, groups.pp_rank)
    ]


def pipeline_loss_fn(config: ModelConfig, groups: ParallelGroups) -> LossFn:
    """The schedule's loss: mean vocab-parallel cross-entropy of one micro-batch.

    It takes the last stage's local logits `(B, T, V_padded / tp)` and labels `(B, T)`
    (-100 = ignored) and returns the mean over the non-ignored labels, as a stage does.
    With context parallelism the logits are this cp rank's tokens and the labels the whole
    sequence's; the mean is over the whole sequence (`context_parallel.global_mean_loss`).
    """
    from tessera.core.parallel.context_parallel import global_mean_loss, split_sequence
    from tessera.core.parallel.layers import vocab_parallel_cross_entropy

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if groups.cp_size > 1:  # this cp rank's logits, the whole sequence's labels
            labels = split_sequence(labels, 1, groups.cp_size, groups.cp_rank)
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), groups.tp_group,
            groups.tp_rank, config.vocab_size)
        if groups.cp_size > 1:
            return global_mean_loss(losses.sum(), (labels != -100).sum(), groups.cp_size,
                                    groups.cp_group)
        return losses.sum() / (labels != -100).sum().clamp(min=1)

    return loss_fn


def build_schedule(
    stages: Sequence[nn.Module],
    layout: Layout,
    schedule: TrainSchedule,
    groups: ParallelGroups,
    loss_fn: LossFn,
) -> Any:
    """Wrap `stages` (from `build_stages`) in `PipelineStage`s and build the schedule named by
    `schedule.schedule`, running `schedule.micro_batches` micro-batches per step.

    Every pipeline rank must call this, with the same `layout` and `schedule`. Raises
    `ConfigError` for a layout the schedule cannot run (see `schedule_problems`).
    """
    import torch.distributed.pipelining as pipelining

    problems = schedule_problems(layout, schedule)
    if problems:
        raise ConfigError("cannot build the pipeline schedule:\n  - " + "\n  - ".join(problems))
    expected = stage_ids(layout, groups.pp_rank)
    got = [m.stage_id for m in stages]
    if got != expected:
        raise ValueError(f"pp rank {groups.pp_rank} should hold stages {expected} for placement "
                         f"{layout.placement!r}, got {got}; build them with build_stages")
    pipe_stages = [
        pipelining.PipelineStage(m, m.stage_id, m.num_stages, _device_of(m),
                                 group=groups.pp_group)
        for m in stages
    ]
    cls = getattr(pipelining, SCHEDULES[schedule.schedule])
    first = pipe_stages[0] if schedule.schedule in _SINGLE_STAGE else pipe_stages
    return cls(first, n_microbatches=schedule.micro_batches, loss_fn=loss_fn)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def pipeline_step(
    schedule: Any,
    stages: Sequence[nn.Module],
    groups: ParallelGroups,
    input_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    document_ids: torch.Tensor | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Run forward and backward of one batch through the pipeline; gradients accumulate.

    `input_ids (B, T)` is needed where the first stage lives and `labels (B, T)` where the last
    one does (other ranks may pass None). Returns, on the rank holding the last stage, the mean
    of the micro-batch losses (detached), and None elsewhere; see `broadcast_loss`.
    `document_ids (B, T)` (packed documents; every rank passes them) reach every stage, and so
    do the keyword tensors `extra` (rows first, split into micro-batches like the ids: a model
    family's own inputs, e.g. BERT's `token_types` and `attention_mask`).
    """
    n_mb = schedule._n_microbatches
    first = any(m.is_first for m in stages)
    last = any(m.is_last for m in stages)
    for name, t, role, needed in (("input_ids", input_ids, "first", first),
                                  ("labels", labels, "last", last)):
        if not needed:
            continue
        if t is None:
            raise ValueError(f"pp rank {groups.pp_rank} holds the {role} stage and needs {name}")
        if t.shape[0] % n_mb:
            raise ValueError(f"{name} batch {t.shape[0]} does not split into {n_mb} equal "
                             f"micro-batches; use a batch that is a multiple of {n_mb}")
    losses: list[torch.Tensor] | None = [] if last else None
    args = (input_ids,) if first else ()
    extra = {**(extra or {}), **({} if document_ids is None else {"document_ids": document_ids})}
    schedule.step(*args, target=labels if last else None, losses=losses, return_outputs=False,
                  local_logits=True, **extra)
    if not last:
        return None
    return torch.stack([loss.detach().float() for loss in losses]).mean()


def broadcast_loss(
    loss: torch.Tensor | None, layout: Layout, groups: ParallelGroups
) -> torch.Tensor:
    """The last stage's loss (from `pipeline_step`) on every rank of the pipeline group."""
    src = last_stage_pp_rank(layout)
    if groups.pp_rank == src:
        if loss is None:
            raise ValueError(f"pp rank {src} holds the last stage and must pass its loss")
        out = loss.detach().float().reshape(())
    else:
        out = torch.zeros((), dtype=torch.float32)
    if groups.pp_group is not None:
        out = out.contiguous()
        dist.broadcast(out, src=groups.pp_ranks[src], group=groups.pp_group)
    return out


def sync_tied_embedding_grads(stages: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Sum the gradients of a tied embedding's two copies (first stage's `tok_embeddings` and
    the last stage's `output`), so both take the same update and stay equal.

    A no-op for untied models and when the first stage is also the last. When the two copies
    live on different ranks their gradients are all-reduced over `groups.embedding_group`; when
    both live on this rank (V schedules put them on pp rank 0) they are summed locally.
    """
    if not stages or not stages[0].config.tied_embeddings:
        return
    copies = [m.tok_embeddings.weight for m in stages if m.is_first and not m.is_last]
    copies += [m.output.weight for m in stages if m.is_last and m.output is not None]
    copies = [p for p in copies if p.requires_grad]  # frozen (prompt tuning): nothing to sync
    if not copies:
        return
    grads = _local_grads(copies)
    if len(grads) == 2:
        total = grads[0] + grads[1]
        for g in grads:
            g.copy_(total)
    elif groups.embedding_group is not None:
        dist.all_reduce(grads[0], group=groups.embedding_group)


def sync_sequence_parallel_grads(modules: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Sum over the tp group the gradients of parameters marked `sequence_parallel=True`.

    Under sequence parallelism each tp rank runs the norms (and adds the row-parallel biases)
    on its own chunk of the sequence, so each holds a partial gradient of these replicated
    parameters. One all-reduce over a flat buffer covers them all. Frozen parameters
    (`requires_grad=False`, as in prompt tuning) are skipped, here and for tied embeddings.
    """
    if groups.tp_group is None:
        return
    params = [p for m in modules for p in m.parameters()
              if getattr(p, "sequence_parallel", False) and p.requires_grad]
    if not params:
        return
    grads = _local_grads(params)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=groups.tp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sync_kv_replica_grads(stages: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Sum the gradients of replicated kv heads over their replica group.

    When tp exceeds `num_kv_heads`, each kv head (its rows of `attention.wqkv`, see
    `sharding.replica_rows`) lives on `tp / num_kv_heads` ranks, and each computes only the
    part of its gradient that flows from its own query heads; the sum is the true gradient, so
    every replica takes the same update and stays equal. A no-op without replication; frozen
    parameters are skipped. Needs `init_groups(..., kv_replicas=...)`.
    """
    from tessera.core.parallel.sharding import replica_rows

    if not stages or groups.tp_size == 1:
        return
    config = stages[0].config
    pieces = []
    for m in stages:
        for local_name, p in m.named_parameters():
            rows = replica_rows(m.global_name(local_name), config, groups.tp_size)
            if rows and p.requires_grad:
                pieces += [(p, a, b) for a, b in rows]
    if not pieces:
        return
    if groups.kv_replica_group is None:
        raise RuntimeError(
            f"num_kv_heads {config.num_kv_heads} < tp {groups.tp_size}: kv heads are replicated "
            "but the groups have no kv replica group; build them with init_groups(parallel, "
            "kv_replicas=sharding.kv_replicas(model_config, tp))")
    grads = _local_grads([p for p, _, _ in pieces])
    if any(g.shape != p.shape for g, (p, _, _) in zip(grads, pieces)):
        raise NotImplementedError(
            f"num_kv_heads {config.num_kv_heads} < tp {groups.tp_size} replicates kv heads, "
            "whose gradients cannot yet be summed when FSDP shards them; use data_parallel "
            "ddp or zero1, or a tp that divides num_kv_heads")
    rows = [g[a:b] for g, (_, a, b) in zip(grads, pieces)]
    flat = torch.cat([r.reshape(-1) for r in rows])
    dist.all_reduce(flat, group=groups.kv_replica_group)
    for r, part in zip(rows, flat.split([r.numel() for r in rows])):
        r.copy_(part.view_as(r))


def _local_grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where none was produced, so every rank reduces the
    same buffers), as the local shard where it is an FSDP2 DTensor."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [_local(p.grad) for p in params]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 (DTensor) gradient; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad
