"""Memory and step time of one training configuration of a T5 (encoder-decoder), from
`plan.models.t5.formulas` and the same rates and rules `estimate` uses for decoder-only models.

What differs from a decoder-only model (`estimate`'s module doc has the shared rules):

- two stacks over two lengths: encoder layers over `s_e = seq_len` tokens, decoder layers over
  `s_d = formulas.t5_decoder_length(seq_len)` (the span-corruption targets) with a
  cross-attention whose k and v run over the encoder output;
- pipeline stages follow `core.models.t5.layout.t5_stage_split` (encoder stages, then decoder
  stages), so stages differ: memory is the most loaded stage's (its parameters, and its
  activations times the micro-batches 1F1B keeps in flight there, `p - stage`), and the step
  runs at the slowest stage's pace, `(m + p - 1)` of its micro-batch slots [PTD-P section 2.2
  with unequal stages: the pipeline's throughput is its slowest stage's];
- a stage boundary carries the hidden states, the stack's relative bias (`(a/t) s^2`, as
  `core.models.t5.model` passes it) and, on the decoder side, the encoder output;
- tensor parallelism: a decoder layer has three all-reduces (or all-gather / reduce-scatter
  pairs) of its `s_d b h` per direction instead of two, and the cross-attention's k/v input
  (the encoder output, replicated over tp) one more of `s_e b h` in the backward (Megatron's
  column-parallel input gradient; with sequence parallelism an all-gather forward and a
  reduce-scatter backward);
- the embedding is used by stage 0 and by the first decoder stage (and, tied, by the last): with
  pp > 1 their gradients are all-reduced after the backward (`core.models.t5.pipeline`).

T5 trains without recomputation, virtual stages, cp, ep and fp8 (`plan.models.t5.rules`), so those
terms are 0 here. Throughput counts encoder tokens (`global_batch x seq_len`).
"""

from __future__ import annotations

from tessera.core.models.t5.layout import t5_stage_layers
from tessera.plan import estimate as E
from tessera.plan import formulas as F
from tessera.plan.models.t5 import formulas as T


def decoder_length(job: E.Job, c: E.Config) -> int:
    """Decoder tokens per sample for `c` (padded to tp under sequence parallelism)."""
    return T.t5_decoder_length(job.seq_len, c.tp, c.sequence_parallel)


def stage_parameters(job: E.Job, c: E.Config) -> list[float]:
    key = ("t5-stage-params", c.pp, c.tp)
    if key not in job.cache:
        job.cache[key] = T.t5_stage_parameters(job.model, c.pp, c.tp)
    return job.cache[key]


def memory(job: E.Job, c: E.Config) -> E.Memory:
    """Peak memory of the most loaded stage: its model state (`formulas.model_state_bytes`,
    `optimizer_state_bytes`) plus its stored activations for the micro-batches in flight there
    (`p - stage` under 1F1B, at most m [Korthikanti section 4.2.3])."""
    model, b, s_e = job.model, c.micro_batch, job.seq_len
    s_d = decoder_length(job, c)
    m = E.micro_batches(job, c)
    best = None
    for stage, params in enumerate(stage_parameters(job, c)):
        w, g, _ = F.model_state_bytes(params, precision=job.precision)
        o = F.optimizer_state_bytes(params, 0, c.dp, c.dp, c.sharded_optimizer,
                                    E._optimizer_bytes(job))
        act = T.t5_stage_activation_bytes(model, stage, c.pp, s_e, s_d, b, c.tp,
                                          c.sequence_parallel, job.flash_attention)
        act *= min(c.pp - stage, m) * job.act_scale
        total = w + g + o + act
        if best is None or total > best[0]:
            best = (total, w, g, o, act)
    _, w, g, o, act = best
    return E.Memory(weights=w / F.GIB, gradients=g / F.GIB, optimizer=o / F.GIB,
                    activations=act / F.GIB, overhead=job.hardware.framework_overhead_gib)


def _attention_time(flops: float, job: E.Job, peak: float) -> float:
    hw = job.hardware
    rate = hw.attention_efficiency if job.flash_attention else hw.unfused_attention_efficiency
    return flops / (peak * rate)


def _layer_forward(job: E.Job, c: E.Config, decoder: bool) -> tuple[float, float]:
    """(compute, tp communication) seconds of one encoder or decoder layer's forward on one
    rank for one micro-batch: its GEMMs at the shape rule's rate, attention at the attention
    rate, one memory-bound pass over its stored activations, the layer's fixed cost; the tp
    collectives averaged over forward and backward (see the module doc)."""
    model, hw, b, tp = job.model, job.hardware, c.micro_batch, c.tp
    peak = hw.peak(job.precision) * 1e12
    h, ad, f = model.hidden_size, model.num_heads * model.head_dim, model.ffn_hidden_size
    s_e, s_d = job.seq_len, decoder_length(job, c)
    up = 2 if model.gated else 1
    T_e, n = b * s_e, ad / tp
    if not decoder:
        T_ = T_e
        gemm = (E._gemm_time(2 * T_ * h * 3 * n, (T_, 3 * n, h), peak, hw)
                + E._gemm_time(2 * T_ * n * h, (T_, h, n), peak, hw))
        att = 4 * T_ * s_e * n
        stored = T.t5_encoder_layer_activation_bytes(model, s_e, b, tp, c.sequence_parallel,
                                                     job.flash_attention)
        comm = F.tp_layer_comm_bytes(s_e, b, h, tp, c.sequence_parallel, job.act_bytes)
        ops = 4 if c.sequence_parallel else 2
    else:
        T_ = b * s_d
        gemm = (E._gemm_time(2 * T_ * h * 3 * n, (T_, 3 * n, h), peak, hw)  # self q, k, v
                + E._gemm_time(2 * T_ * h * n, (T_, n, h), peak, hw)  # cross q
                + E._gemm_time(2 * T_e * h * 2 * n, (T_e, 2 * n, h), peak, hw)  # cross k, v
                + 2 * E._gemm_time(2 * T_ * n * h, (T_, h, n), peak, hw))  # two outputs
        att = 4 * T_ * (s_d + s_e) * n
        stored = T.t5_decoder_layer_activation_bytes(model, s_d, s_e, b, tp,
                                                     c.sequence_parallel, job.flash_attention)
        comm = (1.5 * F.tp_layer_comm_bytes(s_d, b, h, tp, c.sequence_parallel, job.act_bytes)
                + 0.25 * F.tp_layer_comm_bytes(s_e, b, h, tp, c.sequence_parallel,
                                               job.act_bytes))
        ops = 7 if c.sequence_parallel else 4  # per direction, rounded up
    gemm += E._mlp_gemm_time(T_, h, f / tp, up, peak, hw)
    compute = (gemm + _attention_time(att, job, peak)
               + E.ELEMENTWISE_PASSES * stored * job.act_scale / (hw.memory_gbps * 1e9)
               + hw.layer_overhead_us * 1e-6)
    tp_time = E._collective_time(comm, tp, hw, E._bandwidth(hw, True), ops=ops)
    return compute, tp_time


def _ends(job: E.Job, c: E.Config, stage: int) -> float:
    """A stage's work outside its layers per micro-batch: the output layer and the loss over
    the decoder tokens on the last stage (as `estimate.step_time` charges them), the
    embedding's dense backward on stage 0 and on the first decoder stage."""
    model, hw = job.model, job.hardware
    peak = hw.peak(job.precision) * 1e12
    h, V = model.hidden_size, model.vocab_size
    enc, dec = t5_stage_layers(stage, c.pp, model)
    out = 0.0
    if stage == c.pp - 1:
        T_ = c.micro_batch * decoder_length(job, c)
        v_tp = V / c.tp
        out += 3 * E._gemm_time(F.logits_forward_flops(T_, h, V) / c.tp, (T_, v_tp, h), peak, hw)
        out += max(E.LOGITS_PASSES * 4 * T_ * v_tp / (hw.memory_gbps * 1e9),
                   T_ * v_tp * hw.loss_ns_per_logit * 1e-9)
    embedding = F.embedding_backward_bytes(V, h, c.tp, job.act_bytes) / (hw.memory_gbps * 1e9)
    out += embedding * ((stage == 0) + (c.pp > 1 and len(dec) > 0 and dec.start == 0))
    return out + hw.microbatch_overhead_us * 1e-6


def _p2p_time(job: E.Job, c: E.Config) -> float:
    """The largest stage-boundary transfer: each tp rank's slice of the hidden states (and on
    the decoder side of the encoder output) and its heads' relative bias, over the link
    between the stages, plus without sequence parallelism the receivers' all-gather [PTD-P
    section 4.1, as `estimate._p2p_time`]."""
    model, hw, b, d = job.model, job.hardware, c.micro_batch, job.act_bytes
    h, a, tp = model.hidden_size, model.num_heads, c.tp
    s_e, s_d = job.seq_len, decoder_length(job, c)
    enc_side = s_e * b * h * d / tp + a / tp * s_e**2 * d
    dec_side = (s_d + s_e) * b * h * d / tp + a / tp * s_d**2 * d
    hidden = (s_d + s_e) * b * h * d
    gather = 0.0 if tp == 1 or c.sequence_parallel else F.allgather_bytes(hidden, tp)
    return (max(enc_side, dec_side) / E._p2p_bandwidth(hw, E._pp_intra(job, c))
            + hw.link_latency_us * 1e-6
            + E._collective_time(gather, tp, hw, E._bandwidth(hw, True), ops=1))


def step_time(job: E.Job, c: E.Config) -> E.StepTime:
    """Predicted time of one training step of T5 configuration `c` (see the module doc)."""
    model, hw = job.model, job.hardware
    enc_c, enc_tp = _layer_forward(job, c, decoder=False)
    dec_c, dec_tp = _layer_forward(job, c, decoder=True)
    slots = []
    for stage in range(c.pp):
        enc, dec = t5_stage_layers(stage, c.pp, model)
        compute = 3 * (len(enc) * enc_c + len(dec) * dec_c) + _ends(job, c, stage)
        tp = 2 * (len(enc) * enc_tp + len(dec) * dec_tp)
        slots.append((compute + tp, compute, tp, len(enc) * enc_c + len(dec) * dec_c))
    slowest = max(slots)
    per_mb, compute, tp, fwd = slowest
    m = E.micro_batches(job, c)
    bubble = (c.pp - 1) * per_mb
    pp_time = 0.0
    if c.pp > 1:
        pp_time = F.pipeline_critical_transfers(c.pp, m) * _p2p_time(job, c)
        sync = F.embedding_grad_sync_bytes(model.vocab_size, model.hidden_size, c.tp,
                                           job.grad_reduce_bytes)
        pp_time += E._collective_time(sync, 2, hw, E._bandwidth(hw, E._pp_intra(job, c)),
                                      ops=1)
    params = max(stage_parameters(job, c))
    dp_full = E._dp_reduce_time(job, c, params, c.dp, c.tp)
    window = 2 * fwd + tp / 2 if E.overlaps_grad_reduce(job, c) else 0.0
    dp_time = max(0.0, dp_full - window)
    opt_params = F.optimizer_state_bytes(params, 0, c.dp, c.dp, c.sharded_optimizer,
                                         bytes_per_param=1)
    optimizer = E.OPTIMIZER_STEP_BYTES * opt_params / (hw.memory_gbps * 1e9)
    return E.StepTime(compute=m * compute, recompute=0.0, bubble=bubble, tp=m * tp,
                      pp=pp_time, dp=dp_time, cp=0.0, ep=0.0, optimizer=optimizer)


def step_flops(job: E.Job) -> float:
    """FLOPs of one step (`formulas.t5_flops_per_step`; no recomputation), over the decoder
    length of the unpadded targets."""
    return T.t5_flops_per_step(job.model, job.global_batch, job.seq_len,
                               T.t5_decoder_length(job.seq_len))
