"""The serving planner: does a model fit for inference, with which tp/pp, and how fast.

Memory per GPU: the weights of its shard (16-bit, or FP8 for every transformer linear with the
embedding and output layers kept in 16 bits, as Tessera's FP8 export does), the KV cache of
`batch` sequences of `context` tokens [Pope et al. 2022, section 2], and the framework overhead.
Time per output token (one decode step) is memory bound at small batch: every stage streams
its weights and its KV cache through HBM, one stage after another, plus two tensor-parallel
all-reduces per layer of the step's activations (latency dominated) [Pope et al. 2022,
section 3.1; PTD-P section 3.2 for the all-reduces].
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.core.config import Layout, ModelConfig, divisors
from tessera.plan import formulas as F
from tessera.plan.cluster import check_gpu_count, fills_whole_nodes
from tessera.plan.errors import PlanError
from tessera.plan.hardware import Hardware

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp32": 4.0}


@dataclass(frozen=True)
class ServingOption:
    """One tp x pp layout for one replica; `replicas` copies fill the GPUs."""

    tp: int
    pp: int
    replicas: int
    weights_gib: float  # per GPU
    kv_cache_gib: float  # per GPU, for `batch` sequences of `context` tokens
    overhead_gib: float
    capacity_gib: float
    fits: bool
    max_batch: int  # sequences of `context` tokens the free memory holds (0: none)
    time_per_token_s: float  # one decode step at `batch`
    tokens_per_s: float  # over all replicas at `batch` per replica

    @property
    def memory_gib(self) -> float:
        return self.weights_gib + self.kv_cache_gib + self.overhead_gib


@dataclass(frozen=True)
class ServingPlan:
    """The verdict: `fits`, the recommended option (None when nothing fits), every valid option
    fastest first, and a plain message."""

    model: str
    precision: str
    gpus: int
    hardware: str
    fits: bool
    recommended: ServingOption | None
    options: list[ServingOption] = field(default_factory=list)
    message: str = ""


def _weight_bytes(model: ModelConfig, precision: str) -> tuple[float, float, float, float]:
    """(transformer-body, embedding, output, tp-replicated) bytes of the whole model; a tied
    output layer counts as a second copy (the last pipeline stage holds one when pp > 1); the
    last is the part of the body every tp rank holds whole (multi-head latent attention's
    down-projections)."""
    if precision not in WEIGHT_BYTES:
        raise PlanError(f"unknown serving precision {precision!r}; choose one of "
                        f"{sorted(WEIGHT_BYTES)}")
    counts = F.parameter_counts(model)
    body = counts.body_dense + counts.body_experts + counts.final_norm
    edge_bytes = 2.0 if precision == "fp8" else WEIGHT_BYTES[precision]
    replicated = counts.num_layers * counts.layer_replicated
    return (body * WEIGHT_BYTES[precision], counts.embedding * edge_bytes,
            counts.output * edge_bytes, replicated * WEIGHT_BYTES[precision])


def plan_serving(
    model: ModelConfig,
    gpus: int,
    hardware: Hardware,
    precision: str = "bf16",
    batch: int = 1,
    context: int | None = None,
    gpus_per_node: int = 8,
    kv_precision: str | None = None,
    max_latency_ms: float | None = None,
    min_throughput: float | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> ServingPlan:
    """Whether `model` fits on `gpus` x `hardware` for inference in `precision`, and how.

    Tries every tp (dividing the node, valid for the heads) x pp (dividing the layers) whose
    product divides `gpus`, with `batch` sequences of `context` tokens (default: the model's
    maximum) per replica; the KV cache is in `kv_precision` (default: bf16). Recommends the
    fastest fitting option that meets `max_latency_ms` (per output token) and
    `min_throughput` (tokens/s over all replicas), or says plainly that nothing fits, with
    the fewest GPUs that would hold it, or what the constraints would have to be. `tp` / `pp`
    fix those sizes (PlanError, saying which are valid, when none is).
    """
    from tessera.plan.models.registry import plan_family

    refused = plan_family(model).mode_problems(model, serve=True)
    if refused:
        raise PlanError("; ".join(refused))
    check_gpu_count(gpus, gpus_per_node)
    if context and model.position == "learned" and context > model.max_position_embeddings:
        raise PlanError(f"context {context} exceeds {model.name}'s "
                        f"{model.max_position_embeddings} learned positions; use --context "
                        f"<= {model.max_position_embeddings}")
    context = context or model.max_position_embeddings
    options = _options(model, gpus, hardware, precision, batch, context, gpus_per_node,
                       kv_precision, tp, pp)
    body, emb, out, _ = _weight_bytes(model, precision)
    edge = emb + out
    ok = [o for o in options if o.fits
          and (max_latency_ms is None or o.time_per_token_s * 1e3 <= max_latency_ms)
          and (min_throughput is None or o.tokens_per_s >= min_throughput)]
    total_gib = (body + edge) / F.GIB
    name = f"{model.name} ({precision})"
    if ok:
        best = ok[0]
        message = (f"{name} fits on {gpus} x {hardware.name}: tp {best.tp} pp {best.pp} "
                   f"({best.replicas} replica(s)), {best.memory_gib:.1f} of "
                   f"{hardware.memory_gib:.1f} GiB per GPU, up to {best.max_batch} sequences of "
                   f"{context} tokens, {best.time_per_token_s * 1e3:.1f} ms per output token")
        if precision == "fp8" and "fp8" not in hardware.peak_tflops:
            # vLLM's docs: without FP8 tensor cores (before sm_89) FP8 checkpoints run as W8A16.
            message += (f"; {hardware.name} has no FP8 tensor cores, so this is weight-only FP8 "
                        "(W8A16: weights widened to 16 bits inside each GEMM, as vLLM's FP8 "
                        "Marlin kernels run them): decode keeps the halved weight reads, "
                        "prefill runs at the 16-bit rate")
        return ServingPlan(model.name, precision, gpus, hardware.name, True, best, options,
                           message)
    fitting = [o for o in options if o.fits]
    if fitting:
        fastest = min(fitting, key=lambda o: o.time_per_token_s)
        most = max(fitting, key=lambda o: o.tokens_per_s)
        asked = ", ".join(t for t in (
            f"at most {max_latency_ms:g} ms per output token" if max_latency_ms else "",
            f"at least {min_throughput:,.0f} tokens/s" if min_throughput else "") if t)
        message = (f"{name} fits on {gpus} x {hardware.name}, but no layout meets the latency "
                   f"/ throughput limits ({asked}) at {batch} sequence(s) per replica: the "
                   f"fastest, tp {fastest.tp} pp {fastest.pp}, takes "
                   f"{fastest.time_per_token_s * 1e3:.2f} ms per token; "
                   f"the most tokens/s, tp {most.tp} pp {most.pp}, gives "
                   f"{most.tokens_per_s:,.0f}. Relax the limit to that, raise --concurrency "
                   "for throughput, or add GPUs")
    else:
        more = _fewest_gpus(model, gpus, hardware, precision, batch, context, gpus_per_node,
                            kv_precision, tp, pp)
        kv_gib = batch * F.kv_cache_bytes(model, context, WEIGHT_BYTES[kv_precision or "bf16"]
                                          ) / F.GIB
        fewer = max(o.max_batch for o in options)
        message = (f"{name} does not fit on {gpus} x {hardware.name}: its weights are "
                   f"{total_gib:.0f} GiB and the KV cache of {batch} sequence(s) of {context} "
                   f"tokens {kv_gib:.0f} GiB, against {gpus * hardware.memory_gib:.0f} GiB of "
                   f"memory; " + (f"{more} GPUs would hold it" if more else
                                  f"{8 * gpus} GPUs would not hold it either")
                   + (", or FP8 weights" if precision != "fp8" else "")
                   + (f", or at most {fewer} concurrent sequences" if 0 < fewer < batch else ""))
    return ServingPlan(model.name, precision, gpus, hardware.name, False, None, options,
                       message)


def _options(model: ModelConfig, gpus: int, hardware: Hardware, precision: str, batch: int,
             context: int, gpus_per_node: int, kv_precision: str | None, tp: int | None,
             pp: int | None) -> list[ServingOption]:
    """Every layout (tp and pp as fixed, when they are), fitting ones first, fastest first."""
    layouts = _layouts(model, gpus, gpus_per_node)
    chosen = [(t, p) for t, p in layouts if tp in (None, t) and pp in (None, p)]
    if not chosen:
        fixed = ", ".join(f"{k} {v}" for k, v in (("tp", tp), ("pp", pp)) if v is not None)
        raise PlanError(f"no serving layout of {model.name} on {gpus} GPUs has {fixed}: tp must "
                        f"divide the {gpus_per_node}-GPU node and the heads, pp the layers, and "
                        f"tp x pp the GPUs; valid (tp, pp): "
                        + ", ".join(f"({t}, {p})" for t, p in layouts))
    body, emb, out, whole = _weight_bytes(model, precision)
    edge = emb + out
    kv_bytes = WEIGHT_BYTES[kv_precision or "bf16"]
    kv_per_seq = F.kv_cache_bytes(model, context, kv_bytes)
    bw = hardware.memory_gbps * 1e9
    options = []
    for tp, pp in chosen:
        # Replicated kv heads, or an MLA latent, are stored on several tp ranks.
        kv_rep = F.kv_cache_tp_copies(model, tp)
        split_body = body - whole + whole * tp  # the tp-replicated part once per rank
        # The first stage holds the embedding, the last the output layer (pp 1: both).
        w = split_body / (tp * pp) + (edge if pp == 1 else max(emb, out or emb)) / tp
        kv = batch * kv_per_seq * kv_rep / (tp * pp)
        cap = hardware.memory_gib * F.GIB
        over = hardware.framework_overhead_gib * F.GIB
        fits = w + kv + over <= cap
        free = cap - w - over
        max_batch = max(0, int(free // (kv_per_seq * kv_rep / (tp * pp))))
        step = (split_body / tp + edge / tp + batch * kv_per_seq * kv_rep / tp) / bw
        if tp > 1:
            msg = F.allreduce_bytes(batch * model.hidden_size * 2, tp)
            per = msg / (hardware.intra_node_gbps * 1e9 * hardware.comm_efficiency) + \
                hardware.link_latency_us * 1e-6
            step += 2 * model.num_layers * per
        if pp > 1:
            step += (pp - 1) * hardware.link_latency_us * 1e-6
        replicas = gpus // (tp * pp)
        options.append(ServingOption(
            tp=tp, pp=pp, replicas=replicas, weights_gib=w / F.GIB, kv_cache_gib=kv / F.GIB,
            overhead_gib=hardware.framework_overhead_gib,
            capacity_gib=hardware.memory_gib, fits=fits, max_batch=max_batch,
            time_per_token_s=step, tokens_per_s=replicas * batch / step))
    options.sort(key=lambda o: (not o.fits, o.time_per_token_s))
    return options


def _layouts(model: ModelConfig, gpus: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (tp, pp) a replica can use: tp divides the node (and the heads), pp the layers,
    and tp x pp the GPUs."""
    return [(tp, pp) for tp in divisors(min(gpus, gpus_per_node)) if gpus_per_node % tp == 0
            for pp in divisors(model.num_layers)
            if not gpus % (tp * pp) and not Layout(tp=tp, pp=pp).problems(model)]


def _fewest_gpus(model: ModelConfig, gpus: int, hardware: Hardware, precision: str,
                 batch: int, context: int, gpus_per_node: int, kv_precision: str | None,
                 tp: int | None, pp: int | None) -> int | None:
    """The fewest GPUs (more than `gpus`, up to 8x as many) on which some layout holds the
    model with `batch` sequences of `context` tokens; None when none does."""
    for n in range(gpus + 1, 8 * gpus + 1):
        if not fills_whole_nodes(n, gpus_per_node):
            continue
        try:
            options = _options(model, n, hardware, precision, batch, context, gpus_per_node,
                               kv_precision, tp, pp)
        except PlanError:
            continue  # no layout with the fixed tp/pp on this count
        if any(o.fits for o in options):
            return n
    return None
