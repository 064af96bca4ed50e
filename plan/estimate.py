"""Memory and step time of one training configuration, from `formulas` and a `Hardware`.

Inputs: a `Job` (model, hardware, batch, sequence, precision) and a `Config` (layout,
micro-batch, recomputation). Outputs: `memory(job, c)` -> `Memory` (GiB of the most loaded
rank, by part) and `step_time(job, c)` -> `StepTime` (seconds by part: compute, bubble, tp / pp
/ dp / cp / ep communication, optimizer), at the pace of the slowest pipeline rank.
Invariants: no torch and no measurement (planning is instant); every rate comes from
`Hardware`, every count from `formulas`; backward costs twice the forward.

The time model term by term, MoE costs and the known limits: docs/planner-model.md, "The
step-time model, term by term".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tessera.core.config import Layout, ModelConfig
from tessera.core.parallel.expert_groups import edp_size
from tessera.plan import formulas as F
from tessera.plan.hardware import Hardware
from tessera.plan.models.registry import plan_family

# How many times the memory-bound ops move the bytes of a layer's stored activations in a
# forward pass. Fused kernels (bias-GeLU, bias-dropout-add, scale-mask-softmax, as Megatron
# runs them) touch each stored tensor about once; fitted with the GEMM constants on PTD-P.
ELEMENTWISE_PASSES = 1.0
# Bytes per gradient element in the data-parallel reduction (fp32 main grads, as Megatron
# keeps for bf16 training) and per weight element in a sharded optimizer's all-gather.
GRAD_REDUCE_BYTES = 4
PARAM_GATHER_BYTES = 2
# Bytes an Adam step moves per parameter: reads 16-bit weight, fp32 grad, master, m, v (18),
# writes 16-bit weight, master, m, v (14).
OPTIMIZER_STEP_BYTES = 32
# Bytes per element of the fp32 logits the cross-entropy reads and writes, and how often.
LOGITS_PASSES = 3


@dataclass(frozen=True)
class Config:
    """One point of the search space (every dimension fixed)."""

    tp: int
    pp: int
    virtual_stages: int
    cp: int
    ep: int
    etp: int  # expert-tensor-parallel size (Layout.etp): each routed expert's FFN over etp
    dp: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str  # none | selective | full
    recompute_layers: int | None  # full: layers recomputed per stage (None: all)
    sharded_optimizer: bool


@dataclass(frozen=True)
class Memory:
    """Peak memory of the most loaded rank, GiB."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class StepTime:
    """One training step, seconds, split by cause; `total` is their sum. `compute` includes the
    recomputed forward (also shown alone as `recompute`, not added twice)."""

    compute: float
    recompute: float
    bubble: float
    tp: float
    pp: float
    dp: float  # exposed part of the data-parallel reduction
    cp: float
    ep: float
    optimizer: float

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp + self.pp + self.dp + self.cp + self.ep
                + self.optimizer)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class Job:
    """What `estimate` needs of a training job (see `search.TrainingJob`)."""

    model: ModelConfig
    hardware: Hardware
    global_batch: int
    seq_len: int
    gpus_per_node: int
    precision: str
    flash_attention: bool
    overlap_grad_reduce: bool
    grad_reduce_bytes: int = GRAD_REDUCE_BYTES
    overlap_grad_reduce_in_pipeline: bool = True
    # Per-job values every configuration shares (parameter counts, FLOPs), computed once.
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def counts(self) -> F.ParameterCounts:
        if "counts" not in self.cache:
            self.cache["counts"] = counts_of(self.model)
        return self.cache["counts"]

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: 4 in fp32 (CPU runs), else 2."""
        return 4 if self.precision == "fp32" else 2

    @property
    def act_scale(self) -> float:
        """Activation bytes relative to the papers' 16-bit counts."""
        return self.act_bytes / 2

    def units(self) -> F.LayerActivations:
        if "units" not in self.cache:
            self.cache["units"] = F.layer_activation_units(self.model, self.flash_attention)
        return self.cache["units"]


def moe_fields(model: ModelConfig) -> tuple[int, int, int | None]:
    """(num_experts, experts_per_token, expert FFN size or None) of `model` (`model.moe`);
    num_experts 0 for a dense model."""
    moe = model.moe
    return moe.num_experts, moe.top_k or (1 if moe.num_experts else 0), moe.ffn_hidden_size


def counts_of(model: ModelConfig) -> F.ParameterCounts:
    """`formulas.parameter_counts` of `model` (dense and MoE layers from its fields)."""
    return F.parameter_counts(model)


def _mix(counts: F.ParameterCounts, dense: float, moe: float) -> float:
    """The model's average per layer of a quantity worth `dense` on a dense layer and `moe` on
    an MoE layer: each pipeline rank is taken to hold the model's mix of the two kinds
    (`formulas.expert_params_per_rank` says when that is exact). Returns the one value
    untouched when all layers are of one kind."""
    m, L = counts.num_moe_layers, counts.num_layers
    if m == 0:
        return dense
    if m == L:
        return moe
    return ((L - m) * dense + m * moe) / L


def expert_dp_size(c: Config) -> int:
    """Ranks an expert parameter's gradient is reduced over and its sharded optimizer state
    split over: the expert-data-parallel group (`core.parallel.expert_groups.edp_size`) under
    expert parallelism, dp x cp when ep x etp = 1 (experts are then plain parameters)."""
    if c.ep * c.etp == 1:
        return c.dp * c.cp
    return edp_size(Layout(tp=c.tp, cp=c.cp, dp=c.dp, ep=c.ep, etp=c.etp))


def micro_batches(job: Job, c: Config) -> int:
    return job.global_batch // (c.dp * c.micro_batch)


def memory(job: Job, c: Config) -> Memory:
    """Peak memory per GPU of `c`, by the family's model (`plan.models.registry`)."""
    return plan_family(job.model).memory(job, c)


def decoder_memory(job: Job, c: Config) -> Memory:
    """Peak memory per GPU of a decoder-only model: the larger of the first pipeline rank
    (embedding, the most micro-batches in flight) and the last (output layer and logits, one in
    flight)."""
    model, s, b = job.model, job.seq_len, c.micro_batch
    h, L = model.hidden_size, model.num_layers
    params = F.params_per_rank(job.counts(), c.tp, c.pp, c.ep, c.etp)
    experts = F.expert_params_per_rank(job.counts(), c.pp, c.ep, c.etp)
    w, g, _ = F.model_state_bytes(params, precision=job.precision)
    o = F.optimizer_state_bytes(params - experts, experts, c.dp * c.cp, expert_dp_size(c),
                                c.sharded_optimizer, _optimizer_bytes(job))

    def act(recompute: str, peak: bool = False) -> float:
        """One layer's stored activations: the model's average of its dense and MoE layers
        (`_mix`), or with `peak` the larger of the two (the layer being recomputed)."""
        dense = F.layer_activation_bytes(model, s, b, c.tp, c.sequence_parallel, recompute,
                                         c.cp, job.flash_attention, job.units())
        counts = job.counts()
        if not counts.num_moe_layers:
            return dense
        moe = F.moe_layer_activation_bytes(model, s, b, c.tp, c.sequence_parallel, recompute,
                                           c.cp, job.flash_attention, c.etp)
        if peak:
            return moe if counts.num_moe_layers == L else max(dense, moe)
        return _mix(counts, dense, moe)

    layers_per_chunk = L // (c.pp * c.virtual_stages)
    if c.recompute == "full":
        n = layers_per_chunk if c.recompute_layers is None else min(c.recompute_layers,
                                                                   layers_per_chunk)
        chunk = n * act("full") + (layers_per_chunk - n) * act("none")
        working = act("none", peak=True) if n else 0.0  # a layer's, while recomputing it
    else:
        chunk = layers_per_chunk * act(c.recompute)
        working = act("none") - act("selective") if c.recompute == "selective" else 0.0
    per_mb_rank = c.virtual_stages * chunk  # one micro-batch through all of this rank's layers
    m = micro_batches(job, c)
    sl = s // c.cp
    emb = F.embedding_activation_bytes(sl, b, h, c.tp)
    logits = F.logits_activation_bytes(sl, b, h, model.vocab_size, c.tp)
    first = F.inflight_microbatches(c.pp, m, c.virtual_stages) * (per_mb_rank + emb) + working
    last = per_mb_rank + logits + working
    activations = first + logits if c.pp == 1 else max(first, last)
    return Memory(weights=w / F.GIB, gradients=g / F.GIB, optimizer=o / F.GIB,
                  activations=activations * job.act_scale / F.GIB,
                  overhead=job.hardware.framework_overhead_gib)


def _optimizer_bytes(job: Job) -> float:
    """Optimizer-state bytes per parameter in `job`'s precision (`formulas.model_state_bytes`)."""
    return F.model_state_bytes(1.0, precision=job.precision)[2]


def _bandwidth(hw: Hardware, intra: bool) -> float:
    """Achievable bytes/s of one rank's link for a ring collective."""
    return (hw.intra_node_gbps if intra else hw.inter_node_gbps) * 1e9 * hw.comm_efficiency


def _p2p_bandwidth(hw: Hardware, intra: bool) -> float:
    """Achievable bytes/s of one point-to-point send between two ranks (`Hardware.p2p_efficiency`
    of the link: NCCL drives a lone send/receive below a ring collective's rate)."""
    return (hw.intra_node_gbps if intra else hw.inter_node_gbps) * 1e9 * hw.p2p_efficiency


def _collective_time(bytes_: float, n: int, hw: Hardware, bw: float, ops: int) -> float:
    """`ops` collectives over n ranks moving `bytes_` per rank in all: bandwidth plus a fixed
    start-up latency per operation."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return bytes_ / bw + ops * hw.link_latency_us * 1e-6


def _gemm_time(flops: float, shape: tuple[float, float, float], peak: float, hw: Hardware
               ) -> float:
    return flops / (peak * hw.gemm_fraction(*shape)) if flops else 0.0


@dataclass(frozen=True)
class _LayerTimes:
    gemm: float  # forward GEMMs
    attention: float  # forward attention GEMMs (part of gemm)
    elementwise: float  # forward memory-bound ops
    scores: float  # forward elementwise over unfused attention scores (part of elementwise)
    overhead: float  # forward fixed cost of the layer (Hardware.layer_overhead_us)
    tp: float  # forward tensor-parallel collectives
    cp: float  # forward context-parallel exchange, exposed
    ep: float  # forward expert all-to-alls
    routing: float = 0.0  # MoE: forward router and token permutation (memory bound)
    routing_bwd: float = 0.0  # MoE: their backward (not 2 x forward: see `_routing_times`)


def _layer_times(job: Job, c: Config) -> _LayerTimes:
    """Forward times of the model's average layer (`_mix` of its dense and MoE layers)."""
    counts = job.counts()
    if counts.num_moe_layers == 0:
        return _kind_times(job, c, moe=False)
    moe = _kind_times(job, c, moe=True)
    if counts.num_moe_layers == counts.num_layers:
        return moe
    dense = _kind_times(job, c, moe=False)
    return _LayerTimes(**{k: _mix(counts, getattr(dense, k), getattr(moe, k))
                          for k in _LayerTimes.__dataclass_fields__})


def _mlp_gemm_time(T: float, h: int, f: float, up: int, peak: float, hw: Hardware) -> float:
    """The two GEMMs of an MLP of (per-rank) FFN size f on T tokens: `h -> up f -> h`."""
    return (_gemm_time(2 * T * h * up * f, (T, up * f, h), peak, hw)
            + _gemm_time(2 * T * f * h, (T, h, f), peak, hw))


def _kind_times(job: Job, c: Config, moe: bool) -> _LayerTimes:
    """Forward times of one dense layer, or with `moe` one MoE layer (the top-k routed experts
    and the shared expert in place of the dense MLP)."""
    model, hw, s, b = job.model, job.hardware, job.seq_len, c.micro_batch
    peak = hw.peak(job.precision) * 1e12
    h, a, kv = model.hidden_size, model.num_heads, model.num_kv_heads
    tp, cp = c.tp, c.cp
    sl = s // cp
    T = b * sl  # tokens of one micro-batch on this rank
    experts, topk, moe_ffn = moe_fields(model)
    shared = model.moe.shared_ffn_hidden_size if moe else 0
    gemm = sum(_gemm_time(2 * T * p.n * p.k / (tp if p.split else 1),
                          (T, p.n / tp if p.split == "out" else p.n,
                           p.k / tp if p.split == "in" else p.k), peak, hw)
               for p in F.attention_projections(model))
    qk, v = F.attention_head_dims(model)
    up = 2 if model.gated else 1
    # Tokens a rank brings to an MoE layer (`core.moe.layer`): its own sequence chunk under
    # sequence parallelism (required with tp > 1 and ep x etp > 1), else the whole micro-batch
    # (at ep x etp = 1 every tp rank then runs every expert on every token).
    n_moe = T / tp if c.sequence_parallel else T
    if moe:
        f = moe_ffn or model.ffn_hidden_size
        # Balanced routing: the ep exchange brings a rank n_moe x top-k copies, the etp gather
        # etp x as many, through its E / ep experts' f / etp slices: n_moe k (up + 1) f h MACs.
        per_expert_tokens = n_moe * topk * c.ep * c.etp / experts
        mlp_flops = 2 * n_moe * topk * (up + 1) * f * h
        gemm += _gemm_time(mlp_flops, (per_expert_tokens, f / c.etp, h), peak, hw)
        if shared:  # Qwen2-MoE's shared expert: a dense MLP split over tp, on every token
            gemm += _mlp_gemm_time(T, h, shared / tp, up, peak, hw)
    else:
        f = model.ffn_hidden_size
        gemm += (_gemm_time(2 * T * h * up * f / tp, (T, up * f / tp, h), peak, hw)
                 + _gemm_time(2 * T * f / tp * h, (T, h, f / tp), peak, hw))
    att_flops = 2 * T * s * (a / tp) * (qk + v)
    if job.flash_attention:  # one fused kernel: its own achievable rate, no score tensors
        attention = att_flops / (peak * hw.attention_efficiency)
    else:  # batched GEMMs per head around a separate softmax
        attention = att_flops / (peak * hw.unfused_attention_efficiency)
    gemm += attention

    routing = routing_bwd = 0.0
    if moe:
        stored = F.moe_layer_activation_bytes(model, s, b, tp, c.sequence_parallel, "none", cp,
                                              job.flash_attention, c.etp)
        # The permuted input and expert output are the dispatch's to move (`_routing_times`),
        # not the generic one-pass-per-stored-tensor rule's.
        stored -= F.moe_routed_row_bytes(n_moe, h, topk, c.etp)
        routing, routing_bwd = _routing_times(job, c, n_moe, peak)
    else:
        stored = F.layer_activation_bytes(model, s, b, tp, c.sequence_parallel, "none", cp,
                                          job.flash_attention, job.units())
    bw_hbm = hw.memory_gbps * 1e9
    elementwise = ELEMENTWISE_PASSES * stored * job.act_scale / bw_hbm
    u = job.units()
    scores = ELEMENTWISE_PASSES * (sl * b * h) * u.scores * a * s / h / tp / bw_hbm * job.act_scale

    node = job.gpus_per_node
    tp_bytes = F.tp_layer_comm_bytes(sl, b, h, tp, c.sequence_parallel, job.act_bytes)
    tp_ops = 4 if c.sequence_parallel else 2
    if moe and not shared:  # the routed experts take the rank's tokens as they are:
        tp_bytes, tp_ops = tp_bytes / 2, tp_ops // 2  # attention's half only
    tp_time = _collective_time(tp_bytes, tp, hw, _bandwidth(hw, True), ops=tp_ops)
    cp_time = 0.0
    if cp > 1:
        local_kv = max(1, kv // tp)  # kv heads of this tp rank (replicated when tp > kv)
        cp_bytes = F.cp_layer_comm_bytes(s, b, local_kv, (qk + v) / 2, cp, job.act_bytes)
        comm = _collective_time(cp_bytes, cp, hw, _bandwidth(hw, tp * cp <= node), ops=cp - 1)
        cp_time = max(0.0, comm - attention)  # ring exchange hidden behind attention compute
    ep_time = 0.0
    if moe and c.ep > 1:  # the ep group spans ep x etp consecutive ranks of the stage
        ep_bytes = F.ep_layer_comm_bytes(n_moe, h, topk, c.ep, job.act_bytes)
        ep_time = _collective_time(ep_bytes, c.ep, hw, _bandwidth(hw, c.ep * c.etp <= node),
                                   ops=2)
    if moe and c.etp > 1:  # etp peers are neighbours, as tp peers
        etp_bytes = F.etp_layer_comm_bytes(n_moe, h, topk, c.etp, job.act_bytes)
        ep_time += _collective_time(etp_bytes, c.etp, hw, _bandwidth(hw, True), ops=2)
    return _LayerTimes(gemm=gemm, attention=attention, elementwise=elementwise, scores=scores,
                       overhead=hw.layer_overhead_us * 1e-6, tp=tp_time, cp=cp_time,
                       ep=ep_time, routing=routing, routing_bwd=routing_bwd)


def _routing_times(job: Job, c: Config, tokens: float, peak: float) -> tuple[float, float]:
    """(forward, backward) seconds of an MoE layer's routing and token permutation on one
    rank routing `tokens` tokens: the permute / unpermute kernels
    (`formulas.moe_dispatch_bytes`) and the router's score passes over HBM, and the gating
    GEMM (`formulas.moe_router_flops`, E outputs a token: a thin GEMM) at the slower of its
    shape-rule rate and its input's HBM traffic (`formulas.moe_router_bytes` counts that
    traffic; taken once, as a roofline). Backward: the GEMM's two gradients."""
    model, hw = job.model, job.hardware
    experts, topk, _ = moe_fields(model)
    h, d = model.hidden_size, job.act_bytes
    bw = hw.memory_gbps * 1e9
    disp_f, disp_b = F.moe_dispatch_bytes(tokens, h, topk, experts // c.ep, c.etp, d)
    route_f, route_b = F.moe_router_bytes(tokens, h, experts, d)
    gemm_f = _gemm_time(F.moe_router_flops(tokens, h, experts), (tokens, experts, h), peak, hw)
    input_f, input_b = tokens * h * d, 2 * tokens * h * d  # the GEMM's share of route_*
    fwd = disp_f / bw + (route_f - input_f) / bw + max(gemm_f, input_f / bw)
    bwd = disp_b / bw + (route_b - input_b) / bw + max(2 * gemm_f, input_b / bw)
    return fwd, bwd


def _pp_intra(job: Job, c: Config) -> bool:
    """Whether pipeline neighbours share a node. Ranks are ordered tp (fastest), cp, dp, pp
    (`core.config.Layout`, as Megatron), so consecutive stages are `tp cp dp` ranks apart:
    in one node only when the whole job fits in one."""
    return c.tp * c.cp * c.dp * c.pp <= job.gpus_per_node


def _p2p_time(job: Job, c: Config) -> float:
    """One stage-boundary transfer: each tp rank's slice over the link between the stages
    (InfiniBand unless the job fits in a node), then, without sequence parallelism, the
    receivers' NVLink all-gather that rebuilds the full activation [PTD-P section 4.1]."""
    hw, h = job.hardware, job.model.hidden_size
    sl, b = job.seq_len // c.cp, c.micro_batch
    send = F.pp_p2p_bytes(sl, b, h, c.tp, True, job.act_bytes)
    gather = F.pp_gather_bytes(sl, b, h, c.tp, c.sequence_parallel, job.act_bytes)
    return (send / _p2p_bandwidth(hw, _pp_intra(job, c)) + hw.link_latency_us * 1e-6
            + _collective_time(gather, c.tp, hw, _bandwidth(hw, True), ops=1))


def hardware_flops(job: Job, recompute: str) -> float:
    """FLOPs one step executes for the whole batch, counting a recomputed forward as PTD-P's
    eq. 3 does: layer forward x (3, + the attention part for selective, + 1 for full) plus the
    output layer x 3. For a GPT shape this is exactly `formulas.ptdp_flops_per_iteration`."""
    key = ("flops", recompute)
    if key not in job.cache:
        job.cache[key] = plan_family(job.model).step_flops(job, recompute)
    return job.cache[key]


def decoder_step_flops(job: Job, recompute: str) -> float:
    """FLOPs of one step of a decoder-only model. Dense layers run the dense MLP, MoE layers
    their top-k routed experts and the shared expert (`formulas.moe_active_mlp_weights`); the
    router and the shared expert's gate (E + 1 logits a token) are not counted, as in
    Megatron-LM's `num_floating_point_operations`."""
    model = job.model
    tokens = job.global_batch * job.seq_len
    counts = job.counts()
    logits = F.logits_forward_flops(tokens, model.hidden_size, model.vocab_size)

    def layers(n: int, active_mlp: float | None) -> float:
        lf = F.layer_forward_flops(model, tokens, job.seq_len, active_mlp)
        extra = {"none": 0.0, "selective": lf.attention, "full": lf.total}[recompute]
        return n * (3 * lf.total + extra)

    dense = counts.num_dense_layers
    flops = layers(dense, None) if dense else 0.0
    if counts.num_moe_layers:
        flops += layers(counts.num_moe_layers, F.moe_active_mlp_weights(model))
    return flops + 3 * logits


def overlaps_grad_reduce(job: Job, c: Config) -> bool:
    """Whether `c`'s data-parallel gradient reduction runs during the backward. Megatron-LM as
    PTD-P ran it (`megatron/schedules.py`, 2021): torch DDP's bucketed all-reduce overlaps the
    backward, but only `forward_backward_no_pipelining` wraps the earlier micro-batches in
    `no_sync`; the pipelined schedules do not, so pipelined runs used the local DDP, which
    all-reduces after the whole backward (`train_step`). The published Table 1 launch script
    (`examples/sc21/run_table_1.sh`) passes `--DDP-impl torch` exactly to the pp = 1 rows."""
    return job.overlap_grad_reduce and (c.pp == 1 or job.overlap_grad_reduce_in_pipeline)


def _grad_reduce_window(job: Job, c: Config, layer_backward: float, recompute: float) -> float:
    """Seconds of the last micro-batch's backward the gradient reduction can hide behind:
    every layer's backward with its tensor-parallel collectives, and the recomputed forwards,
    which run inside that backward (checkpointed layers); 0 when it does not overlap."""
    if not overlaps_grad_reduce(job, c):
        return 0.0
    return job.model.num_layers // c.pp * layer_backward + recompute


def step_time(job: Job, c: Config) -> StepTime:
    """Predicted time of one training step of `c`, split by cause, by the family's model."""
    return plan_family(job.model).step_time(job, c)


def decoder_step_time(job: Job, c: Config) -> StepTime:
    """Predicted time of one training step of a decoder-only model (see the module doc)."""
    model, hw = job.model, job.hardware
    peak = hw.peak(job.precision) * 1e12
    lt = _layer_times(job, c)
    fwd = lt.gemm + lt.elementwise + lt.overhead + lt.routing
    bwd = 2 * (lt.gemm + lt.elementwise + lt.overhead) + lt.routing_bwd
    layers_per_chunk = model.num_layers // (c.pp * c.virtual_stages)
    layers_rank = model.num_layers // c.pp
    if c.recompute == "full":
        n = layers_per_chunk if c.recompute_layers is None else min(c.recompute_layers,
                                                                   layers_per_chunk)
        rc_layers = n * c.virtual_stages
        rc = fwd + lt.tp + lt.cp + lt.ep  # the whole forward again, collectives included
    elif c.recompute == "selective":
        rc_layers, rc = layers_rank, lt.attention + lt.scores
    else:
        rc_layers, rc = 0, 0.0
    body_compute = layers_rank * (fwd + bwd)
    body_recompute = rc_layers * rc
    # The output layer and the cross-entropy on the last rank: forward, and 2x backward.
    sl = job.seq_len // c.cp
    T = c.micro_batch * sl
    v_tp = model.vocab_size / c.tp
    h = model.hidden_size
    logits = 3 * _gemm_time(F.logits_forward_flops(T, h, model.vocab_size) / c.tp,
                            (T, v_tp, h), peak, hw)
    # The loss: its memory passes, or where they do not bound it (a CPU's exp and log, measured
    # per logit as `Hardware.loss_ns_per_logit`; 0 on GPUs) its measured time.
    logits += max(LOGITS_PASSES * 4 * T * v_tp / (hw.memory_gbps * 1e9),
                  T * v_tp * hw.loss_ns_per_logit * 1e-9)
    # The word embedding's backward on the first rank (memory bound, its size not the batch's).
    embedding = F.embedding_backward_bytes(model.vocab_size, h, c.tp, job.act_bytes) / (
        hw.memory_gbps * 1e9)
    # A pipeline runs at its slowest rank's pace: the first rank adds the embedding, the last
    # the output layer; with pp == 1 one rank does both.
    ends = logits + embedding if c.pp == 1 else max(logits, embedding)
    # Every rank pays a micro-batch's fixed cost (Hardware.microbatch_overhead_us).
    ends += hw.microbatch_overhead_us * 1e-6
    per_mb_compute = body_compute + ends
    per_mb_comm_tp = layers_rank * 2 * lt.tp  # forward and backward
    per_mb_cp = layers_rank * 2 * lt.cp
    per_mb_ep = layers_rank * 2 * lt.ep
    per_mb = per_mb_compute + body_recompute + per_mb_comm_tp + per_mb_cp + per_mb_ep
    m = micro_batches(job, c)
    # The fill and drain cross the other ranks, whose micro-batches lack the output layer: the
    # last rank's extra work adds to each micro-batch slot, not to the bubble (a replay of
    # Megatron-LM's 2021 interleaved schedule, tests/unit/plan/test_schedule_replay.py).
    body = per_mb - (max(0.0, logits - embedding) if c.pp > 1 else 0.0)
    bubble = (c.pp - 1) / c.virtual_stages * body

    pp_time = 0.0
    if c.pp > 1:
        one = _p2p_time(job, c)
        pp_time = F.pipeline_critical_transfers(c.pp, m, c.virtual_stages) * one
        if model.tied_embeddings:  # first and last stage keep their shared embedding equal
            sync = F.embedding_grad_sync_bytes(model.vocab_size, h, c.tp,
                                               job.grad_reduce_bytes)
            pp_time += _collective_time(sync, 2, hw, _bandwidth(hw, _pp_intra(job, c)), ops=1)

    params = F.params_per_rank(job.counts(), c.tp, c.pp, c.ep, c.etp)
    expert_params = F.expert_params_per_rank(job.counts(), c.pp, c.ep, c.etp)
    n_dp, n_edp = c.dp * c.cp, expert_dp_size(c)
    # Dense gradients are reduced over dp x cp (peers tp x cp ranks apart), expert ones over
    # the expert-data-parallel group (peers ep x etp ranks apart; with ep x etp = 1 the
    # experts are plain parameters, reduced with the dense ones); the two run back to back.
    grid = c.ep * c.etp
    dp_full = (_dp_reduce_time(job, c, params - expert_params, n_dp, c.tp * c.cp)
               + _dp_reduce_time(job, c, expert_params, n_edp,
                                 grid if grid > 1 else c.tp * c.cp))
    dp_time = max(0.0, dp_full - _grad_reduce_window(job, c, bwd + lt.tp, rc_layers * rc))
    # Routed experts replicated over tp (ep x etp = 1) under sequence parallelism: each tp rank
    # routed its own chunk, so their partial gradients are summed over tp after the backward,
    # not overlapped (`core.parallel.pipeline.sync_sequence_parallel_grads`).
    expert_tp_sync = 0.0
    if expert_params and grid == 1 and c.sequence_parallel:
        expert_tp_sync = _collective_time(
            F.allreduce_bytes(expert_params * job.grad_reduce_bytes, c.tp), c.tp, hw,
            _bandwidth(hw, True), ops=1)
    opt_params = F.optimizer_state_bytes(params - expert_params, expert_params, n_dp, n_edp,
                                         c.sharded_optimizer, bytes_per_param=1)
    optimizer = OPTIMIZER_STEP_BYTES * opt_params / (hw.memory_gbps * 1e9)
    return StepTime(compute=m * (per_mb_compute + body_recompute), recompute=m * body_recompute,
                    bubble=bubble, tp=m * per_mb_comm_tp + expert_tp_sync, pp=pp_time,
                    dp=dp_time, cp=m * per_mb_cp, ep=m * per_mb_ep, optimizer=optimizer)


def _dp_reduce_time(job: Job, c: Config, params: float, n: int, stride: int) -> float:
    """The data-parallel gradient reduction of `params` parameters over `n` ranks `stride`
    ranks apart (a ring [Ring]: the bytes per rank barely depend on n): an all-reduce, or
    with a sharded optimizer a reduce-scatter of gradients and an all-gather of weights
    [ZeRO section 7.2.1]. Within a node over NVLink; across nodes each node's `node / stride`
    members share their NICs."""
    if n <= 1 or params <= 0:
        return 0.0
    hw = job.hardware
    per_node = max(1, job.gpus_per_node // stride)
    bw = (_bandwidth(hw, True) if n <= per_node else
          min(_bandwidth(hw, True), per_node * _bandwidth(hw, False)))
    if c.sharded_optimizer:
        vol = (F.allgather_bytes(params * job.grad_reduce_bytes, n)
               + F.allgather_bytes(params * PARAM_GATHER_BYTES, n))
    else:
        vol = F.allreduce_bytes(params * job.grad_reduce_bytes, n)
    return _collective_time(vol, n, hw, bw, ops=2)


def as_dict(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else asdict(obj)
