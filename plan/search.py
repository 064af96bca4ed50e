"""The training planner: enumerate valid parallel configurations, estimate each, rank them.

`plan_training(job)` walks tp x pp x virtual stages x cp x ep x micro-batch x sequence
parallelism x recomputation (each dimension fixed by `Fixed` or searched), keeps what fits in
memory and returns the fastest first. `evaluate(job, fields)` estimates one configuration.

Validity uses the training code's own rules where they are importable without torch
(`core.config.Layout.problems`: heads, kv-head replication, FFN and layer divisibility,
sequence parallelism) and re-implements only the schedule arithmetic of
`core.parallel.pipeline.schedule_problems` (1F1B needs m >= p; the interleaved schedule runs
micro-batches in rounds of p), which lives beside torch. Search bounds: tp divides the node
size (tp never spans nodes); cp is a power of two with s/cp >= `MIN_CP_CHUNK` tokens, at most
one node; micro-batch sizes are powers of two up to `MAX_MICRO_BATCH` unless fixed; ep and etp
only for MoE models: ep among the divisors of dp x cp that divide the experts, etp 1 or tp
(Megatron's default is tp, its parallel-folding guide recommends 1 for fine-grained experts;
any divisor of tp when fixed), both checked by `Layout.problems` like the rest of the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any

from tessera.core.config import Layout, ModelConfig, divisors
from tessera.plan import estimate as E
from tessera.plan.cluster import check_gpu_count
from tessera.plan.errors import PlanError
from tessera.plan.hardware import Hardware
from tessera.plan.models.registry import plan_family

RECOMPUTE = ("none", "selective", "full")
# Layout gains a `cp` field with context parallelism; pass it when the core has it, so its
# own cp rules (sequence divisibility) apply too.
_LAYOUT_CP = "cp" in {f.name for f in fields(Layout)}
MIN_CP_CHUNK = 512
MAX_MICRO_BATCH = 16


@dataclass(frozen=True)
class TrainingJob:
    """What to train on what: the model, the cluster and the batch.

    `tokens` (optional) turns the step time into training days. `flash_attention`: the
    attention runs as one fused kernel (no s^2 score activations; the default, as Tessera's
    SDPA on GPUs); set False to reproduce the 2021-22 papers. `overlap_grad_reduce`: the
    data-parallel gradient reduction overlaps the last backward (modern Megatron, Tessera's
    DDP buckets); False as in the papers' Megatron. `overlap_grad_reduce_in_pipeline`: False
    when the overlap only works without a pipeline (PTD-P's 2021 Megatron: torch DDP for pp = 1,
    local DDP reducing after the backward otherwise). `grad_reduce_bytes`: 4 reduces fp32 main
    grads (Megatron's default for bf16), 2 reduces 16-bit grads (PTD-P's fp16 runs)."""

    model: ModelConfig
    gpus: int
    hardware: Hardware
    global_batch: int
    seq_len: int
    gpus_per_node: int = 8
    tokens: float | None = None
    precision: str = "bf16"
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    grad_reduce_bytes: int = 4
    overlap_grad_reduce_in_pipeline: bool = True

    @cached_property
    def _estimate(self) -> E.Job:
        return E.Job(model=self.model, hardware=self.hardware, global_batch=self.global_batch,
                     seq_len=self.seq_len, gpus_per_node=self.gpus_per_node,
                     precision=self.precision, flash_attention=self.flash_attention,
                     overlap_grad_reduce=self.overlap_grad_reduce,
                     grad_reduce_bytes=self.grad_reduce_bytes,
                     overlap_grad_reduce_in_pipeline=self.overlap_grad_reduce_in_pipeline)


@dataclass(frozen=True)
class Fixed:
    """Dimensions the caller fixes; a None field is searched.

    `recompute_layers` (layers per stage recomputed under `recompute="full"`): with `recompute`
    fixed to "full" and this None, all layers, as `TrainSchedule` reads None; with `recompute`
    searched, full-recompute candidates take the fewest layers that make them fit."""

    tp: int | None = None
    pp: int | None = None
    virtual_stages: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    micro_batch: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None
    recompute_layers: int | None = None
    sharded_optimizer: bool | None = None

    def __post_init__(self) -> None:
        # Layers to recompute only mean something under full recomputation: given alone, they
        # fix it (as `tessera plan --recompute-layers N` does); with another mode, a mistake.
        if self.recompute_layers is None:
            return
        if self.recompute is None:
            object.__setattr__(self, "recompute", "full")
        elif self.recompute != "full":
            raise PlanError(f"recompute_layers={self.recompute_layers} needs recompute='full' "
                            f"(got recompute={self.recompute!r}); drop one of the two")


@dataclass(frozen=True)
class Candidate(E.Config):
    """One configuration (the `estimate.Config` fields it extends) with its prediction.
    `memory` is the most loaded GPU's breakdown in GiB; `time` the step's breakdown in seconds.
    `tflops_per_gpu` counts the FLOPs executed, recomputation included, as PTD-P reports
    (eq. 3); `mfu` counts the model's FLOPs without recomputation over the dense peak, as
    Korthikanti et al. (and PaLM) define it."""

    micro_batches: int  # per step and data-parallel rank (gradient accumulation x pipeline)
    memory: E.Memory
    memory_capacity_gib: float
    fits: bool
    time: E.StepTime
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    tokens_per_s: float
    days: float | None

    @property
    def config(self) -> E.Config:
        """The configuration alone, without the prediction."""
        return E.Config(**{f.name: getattr(self, f.name) for f in fields(E.Config)})

    @property
    def memory_gib(self) -> float:
        return self.memory.total

    @property
    def layout(self) -> str:
        """Short text of the layout, e.g. `tp8 pp8 v2 dp24 sp`."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        parts.append(f"dp{self.dp}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`tessera plan --json`): flat fields plus `memory` and `time`
        breakdowns; `memory_gib` is the peak per GPU."""
        return {
            **asdict(self.config), "micro_batches": self.micro_batches,
            "memory_gib": self.memory_gib, "memory_capacity_gib": self.memory_capacity_gib,
            "fits": self.fits, "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s, "days": self.days,
            "memory": self.memory.to_dict(), "time": self.time.to_dict(),
        }

    def parallel_fields(self) -> dict[str, Any]:
        """The `parallel:` section of a `tessera pretrain` config (`Layout` and `TrainSchedule`
        fields) for this candidate; cp, ep and etp are written when above 1 (Layout's defaults
        are 1), so the run holds the expert shards the estimate counted."""
        schedule = "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"
        out: dict[str, Any] = {
            "tp": self.tp, "pp": self.pp, "virtual_stages": self.virtual_stages, "dp": self.dp,
            "sequence_parallel": self.sequence_parallel, "schedule": schedule,
            "micro_batches": self.micro_batches, "recompute": self.recompute,
            "recompute_layers": self.recompute_layers,
            "data_parallel": "zero1" if self.sharded_optimizer else "ddp",
        }
        if self.cp > 1:
            out["cp"] = self.cp
        if self.ep > 1:
            out["ep"] = self.ep
        if self.etp > 1:
            out["etp"] = self.etp
        return out


def _config_of(fields_: dict[str, Any], job: TrainingJob) -> E.Config:
    known = {f.name for f in fields(E.Config)} | {"dp"}
    unknown = sorted(set(fields_) - known)
    if unknown:
        raise PlanError(f"unknown configuration fields {unknown}; known: {sorted(known)}")
    tp, pp, cp = fields_.get("tp", 1), fields_.get("pp", 1), fields_.get("cp", 1)
    dp = fields_.get("dp") or job.gpus // (tp * pp * cp)
    sp = fields_.get("sequence_parallel")
    return E.Config(
        tp=tp, pp=pp, virtual_stages=fields_.get("virtual_stages", 1), cp=cp,
        ep=fields_.get("ep", 1), etp=fields_.get("etp", 1), dp=dp,
        micro_batch=fields_.get("micro_batch", 1),
        sequence_parallel=bool(tp > 1 if sp is None else sp),
        recompute=fields_.get("recompute", "none"),
        recompute_layers=fields_.get("recompute_layers"),
        sharded_optimizer=bool(fields_.get("sharded_optimizer", dp * cp > 1)))


def config_problems(job: TrainingJob, c: E.Config) -> list[str]:
    """Every reason configuration `c` cannot run `job` (empty when it can)."""
    model = job.model
    out: list[str] = []
    if c.tp * c.pp * c.cp * c.dp != job.gpus:
        out.append(f"tp {c.tp} x pp {c.pp} x cp {c.cp} x dp {c.dp} = "
                   f"{c.tp * c.pp * c.cp * c.dp}, not the {job.gpus} GPUs")
    if c.tp > job.gpus_per_node or job.gpus_per_node % c.tp:
        out.append(f"tp {c.tp} must divide the {job.gpus_per_node} GPUs of a node (tensor "
                   "parallelism stays on NVLink)")
    out += [p for p in _layout(c.tp, c.pp, c.virtual_stages, c.sequence_parallel, c.cp,
                               max(1, c.dp), c.ep, c.etp).problems(model, seq_len=job.seq_len)
            if p not in out]
    if _LAYOUT_CP:
        pass  # Layout.problems names the cp rules itself
    elif c.cp > 1 and job.seq_len % (2 * c.cp):
        out.append(f"sequence {job.seq_len} is not divisible by 2 x cp = {2 * c.cp} (the "
                   "load-balanced causal split)")
    elif c.cp > 1 and c.sequence_parallel and (job.seq_len // c.cp) % c.tp:
        out.append(f"each cp rank's {job.seq_len // c.cp} tokens do not split over tp {c.tp} "
                   "(sequence parallel)")
    if c.recompute not in RECOMPUTE:
        out.append(f"unknown recompute {c.recompute!r}; choose one of {list(RECOMPUTE)}")
    else:
        out += plan_family(model).config_problems(model, c.recompute)
    if c.dp < 1 or job.global_batch % c.dp:
        out.append(f"global batch {job.global_batch} is not divisible by dp {c.dp}")
    elif (job.global_batch // c.dp) % c.micro_batch:
        out.append(f"per-data-parallel batch {job.global_batch // c.dp} is not divisible by "
                   f"micro-batch {c.micro_batch}")
    else:
        m = job.global_batch // (c.dp * c.micro_batch)
        if c.pp > 1 and m < c.pp:
            out.append(f"{m} micro-batches cannot fill {c.pp} pipeline stages (1F1B needs "
                       f"m >= p); lower the micro-batch or pp")
        if c.virtual_stages > 1:
            rounds = max(1, m // c.pp)
            if m % rounds:
                out.append(f"the interleaved schedule runs micro-batches in rounds of pp "
                           f"{c.pp}: {m} micro-batches must be a multiple of {rounds}")
    return out


def _candidate(job: TrainingJob, c: E.Config, mem: E.Memory | None = None) -> Candidate:
    ej = job._estimate
    mem = mem or E.memory(ej, c)
    t = E.step_time(ej, c)
    step = t.total
    tokens = job.global_batch * job.seq_len
    peak = job.hardware.peak(job.precision)
    hw_flops = E.hardware_flops(ej, c.recompute)
    model_flops = E.hardware_flops(ej, "none")
    tps = tokens / step
    return Candidate(
        **{f.name: getattr(c, f.name) for f in fields(E.Config)},
        micro_batches=E.micro_batches(ej, c),
        memory=mem, memory_capacity_gib=job.hardware.memory_gib,
        fits=mem.total <= job.hardware.memory_gib, time=t, step_time_s=step,
        tflops_per_gpu=hw_flops / step / job.gpus / 1e12,
        mfu=model_flops / step / job.gpus / (peak * 1e12), tokens_per_s=tps,
        days=job.tokens / tps / 86400 if job.tokens else None)


def evaluate(job: TrainingJob, candidate_fields: dict[str, Any]) -> Candidate:
    """Estimate one configuration given as fields (`tp`, `pp`, `virtual_stages`, `cp`, `ep`,
    `micro_batch`, `sequence_parallel`, `recompute`, `recompute_layers`,
    `sharded_optimizer`, optionally `dp`; missing ones default to 1 / off / none, dp to what
    the GPUs leave). Raises `PlanError` naming every rule it breaks; a configuration that runs
    out of memory is returned with `fits=False`."""
    _check_job(job)
    c = _config_of(dict(candidate_fields), job)
    problems = config_problems(job, c)
    if problems:
        raise PlanError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return _candidate(job, c)


def _check_job(job: TrainingJob) -> None:
    check_gpu_count(job.gpus, job.gpus_per_node)
    job.hardware.peak(job.precision)  # PlanError when the card lacks the precision
    refused = plan_family(job.model).job_problems(job.model, job.precision)
    if refused:
        raise PlanError("; ".join(refused))
    if job.global_batch < 1 or job.seq_len < 1:
        raise PlanError("global_batch and seq_len must be >= 1")
    m = job.model
    if m.position == "learned" and job.seq_len > m.max_position_embeddings:
        raise PlanError(f"seq_len {job.seq_len} exceeds the model's {m.max_position_embeddings} "
                        "learned positions")


def _layout(tp: int, pp: int, v: int, sp: bool, cp: int, dp: int = 1, ep: int = 1,
            etp: int = 1) -> Layout:
    extra = {"cp": cp} if _LAYOUT_CP else {}
    return Layout(tp=tp, pp=pp, virtual_stages=v, dp=dp, sequence_parallel=sp, ep=ep, etp=etp,
                  **extra)


def _choices(fixed_value: Any, options: list[Any]) -> list[Any]:
    return [fixed_value] if fixed_value is not None else options


def _configs(job: TrainingJob, fixed: Fixed, fit_only: bool = False) -> Iterator[E.Config]:
    """Every valid configuration (recompute_layers still to be settled for full recompute).
    `fit_only`: only the most memory-frugal settings of each layout (used to say what fits)."""
    model, n, s = job.model, job.gpus, job.seq_len
    L = model.num_layers
    experts, _, _ = E.moe_fields(model)
    tps = [t for t in divisors(min(job.gpus_per_node, n)) if job.gpus_per_node % t == 0]
    cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if s % (2 * c) == 0 and s // c >= MIN_CP_CHUNK
           and c <= job.gpus_per_node] or [1]
    if fit_only:
        tps = tps[::-1]
    space = plan_family(model).search_space(model)  # None: the decoder's rules below
    if space:
        cps = space["cp"]
    for tp in _choices(fixed.tp, tps):
        for pp in _choices(fixed.pp, space["pp"] if space else divisors(L)):
            for cp in _choices(fixed.cp, cps if fixed.cp is None else []):
                if n % (tp * pp * cp):
                    continue
                dp = n // (tp * pp * cp)
                if job.global_batch % dp:
                    continue
                eps = [e for e in divisors(dp * cp) if experts and experts % e == 0] or [1]
                etps = sorted({1, tp}) if experts else [1]
                per_dp = job.global_batch // dp
                mbs = [b for b in divisors(per_dp) if b <= MAX_MICRO_BATCH and not b & (b - 1)]
                if fit_only:
                    mbs = mbs[:1]
                vs = [v for v in divisors(L // pp) if pp > 1 or v == 1] if L % pp == 0 else []
                if space:  # e.g. T5: one stage per rank; pp need not divide its encoder
                    vs = space["virtual_stages"]
                if fit_only:
                    vs = vs[:1]
                sps = [False, True] if tp > 1 and s % tp == 0 else [False]
                if fit_only:
                    sps = sps[-1:]
                recs = ["full"] if fit_only else list(RECOMPUTE)
                if space:
                    recs = space["recompute"]
                experts_grid = [(ep, etp) for ep in _choices(fixed.ep, eps)
                                for etp in _choices(fixed.etp, etps)]
                if fit_only:  # the most frugal: the largest expert grid
                    experts_grid = sorted(experts_grid, key=lambda g: g[0] * g[1])[-1:]
                for ep, etp in experts_grid:
                    for v in _choices(fixed.virtual_stages, vs):
                        for sp in _choices(fixed.sequence_parallel, sps):
                            lay = _layout(tp, pp, v, sp, cp, dp, ep, etp)
                            if lay.problems(model, seq_len=s):
                                continue
                            for b in _choices(fixed.micro_batch, mbs):
                                for rc in _choices(fixed.recompute, recs):
                                    c = E.Config(
                                        tp=tp, pp=pp, virtual_stages=v, cp=cp, ep=ep, etp=etp,
                                        dp=dp, micro_batch=b, sequence_parallel=sp,
                                        recompute=rc, recompute_layers=_layers_to_recompute(
                                            fixed.recompute_layers, model, pp, v),
                                        sharded_optimizer=(dp * cp > 1
                                                           if fixed.sharded_optimizer is None
                                                           else fixed.sharded_optimizer))
                                    if not config_problems(job, c):
                                        yield c


def _layers_to_recompute(fixed: int | None, model: ModelConfig, pp: int, v: int) -> int | None:
    """The fixed layers to recompute as a candidate with `pp` x `v` chunks runs them: a count
    of at least a chunk's layers recomputes them all, which None says (`estimate.memory`)."""
    if fixed is None or fixed < model.num_layers // (pp * v):
        return fixed
    return None


def _settle_recompute_layers(job: TrainingJob, c: E.Config, fixed: Fixed) -> E.Config | None:
    """Full recomputation of how many layers per stage. Fixed (`Fixed.recompute="full"` or a
    fixed `recompute_layers`): as given, None meaning all layers, as in `TrainSchedule`.
    Searched: the fewest layers whose recomputation makes `c` fit (all when even that does
    not fit), or None (skip) when it fits without any (the `recompute="none"` candidate)."""
    if c.recompute != "full" or fixed.recompute == "full" or fixed.recompute_layers is not None:
        return c
    ej = job._estimate
    cap = job.hardware.memory_gib
    per_chunk = job.model.num_layers // (c.pp * c.virtual_stages)
    all_ = E.memory(ej, replace(c, recompute_layers=None)).total
    if all_ > cap:
        return replace(c, recompute_layers=None)  # does not fit; reported as such
    zero = E.memory(ej, replace(c, recompute_layers=0)).total
    if zero <= cap:
        return None
    # Memory falls linearly in the recomputed layers: interpolate, then step up to a fit.
    k = max(1, math.ceil((zero - cap) / (zero - all_) * per_chunk))
    while k < per_chunk and E.memory(ej, replace(c, recompute_layers=k)).total > cap:
        k += 1
    return replace(c, recompute_layers=None if k >= per_chunk else k)


# The model's demonstrated error on throughput: the largest |predicted / measured - 1| over
# the published runs it is checked against in tests/unit/plan/test_search.py: PTD-P (Narayanan
# et al. 2021) Table 1's ten rows as launched, -6.4% (1T; -6.45% unrounded, hence 6.5%) to
# +4.4% (76.1B) (`test_ptdp_table1_published_configurations`), and PTD-P Fig. 12, where the
# interleaved schedule is over-predicted by up to 5.4% and the non-interleaved one is within
# 2% (`test_ptdp_figure_12_schedules`); see docs/planner-model.md, "PTD-P Table 1, 18.4B".
# test_model_error.py recomputes it from those runs, so it follows the model.
MODEL_ERROR = 0.065


def within_model_error(best: Candidate, other: Candidate, error: float = MODEL_ERROR) -> bool:
    """Whether `best` is predicted at most `error` faster than `other` (best's tokens/s <=
    (1 + error) x other's; the same ratio as explain's "X% faster"): the model cannot tell the
    two apart, only a measurement can. True for `best` itself."""
    return best.tokens_per_s <= other.tokens_per_s * (1 + error)


def explain(best: Candidate, other: Candidate) -> str:
    """One line on why `best` beats `other`: the step-time parts that differ the most, and
    whether the difference is within the model's error (`within_model_error`)."""
    a, b = best.time.to_dict(), other.time.to_dict()
    diffs = sorted(((b[k] - a[k], k) for k in a if k not in ("total", "recompute")),
                   reverse=True)
    gains = [f"{k} {b[k] - a[k]:+.3g}s" for d, k in diffs if d > 0][:2]
    gain = (other.step_time_s / best.step_time_s - 1) * 100
    text = (f"{gain:.1f}% faster than {other.layout} mb{other.micro_batch} {other.recompute}: "
            + (", ".join(f"saves {g}" for g in gains) if gains else "same parts, smaller sum"))
    if within_model_error(best, other):
        text += (f"; within the model's {100 * MODEL_ERROR:.1f}% error: too close to call, "
                 "measure both to decide")
    return text
