"""The planner's analytic formulas: small pure functions, each citing where it comes from.

Sources:
- [PTD-P] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, arXiv 2104.04473: parameters and FLOPs (section 5.1, eq. 2-4), pipeline
  bubbles (section 2.2), communication of each parallelism (sections 2.3, 3).
- [Korthikanti] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198: activation memory per layer (section 4, Table 2), the pipeline's
  in-flight activations (section 4.2.3), selective recomputation (section 5).
- [ZeRO] Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", arXiv 1910.02054: bytes per parameter of mixed-precision Adam, sharded optimizer
  states (section 3.1, 5.1).
- [Ring] Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009: a ring all-reduce sends 2(n-1)/n of the buffer per rank; an
  all-gather or a reduce-scatter (n-1)/n.

Notation as in the papers: s sequence, b micro-batch, h hidden, a heads, L layers, V vocabulary,
t tensor-parallel size, p pipeline stages (ranks), v virtual stages per rank, m micro-batches,
B global batch. Activation bytes assume 16-bit activations and 1-byte dropout masks.

The `layer_*` functions generalise the GPT-shaped paper formulas to grouped-query attention, a
gated MLP and any FFN size; for a GPT shape (kv heads = heads, ffn = 4h, GeLU) they equal the
papers' rows exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.core.config import ModelConfig

GIB = 2**30

# --- parameters ----------------------------------------------------------------------------


def ptdp_parameters(num_layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """GPT parameter count [PTD-P section 5.1, eq. 2]:
    `P = 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))` (learned positions, tied embeddings)."""
    L, h = num_layers, hidden
    return 12 * L * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * L * h))


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of a model by where they live.

    A model has `num_layers` layers, `num_moe_layers` of them MoE layers (every
    `moe.layer_freq`-th from layer `moe_first_layer` on, `core.moe.shapes.is_moe_layer`), the
    rest dense. Per layer kind:
    `layer_dense` is one dense layer (attention, norms, dense MLP); `moe_layer_dense` one MoE
    layer's parameters outside the routed experts (attention, norms, router, the shared expert
    and its gate); `moe_layer_experts` its routed experts (all of them); `moe_layer_active`
    what one token uses in one MoE layer (the non-routed part and k routed experts). The
    `body_*` properties sum them over the model's layers."""

    embedding: int  # token (and learned position) embeddings
    word_embedding: int  # the token embedding alone (V h), what a tied output layer copies
    output: int  # output projection, 0 when tied to the embedding
    final_norm: int
    layer_dense: int
    num_layers: int
    num_moe_layers: int = 0
    moe_layer_dense: int = 0
    moe_layer_experts: int = 0
    moe_layer_active: int = 0
    moe_layer_freq: int = 1
    moe_first_layer: int = 0  # `moe.first_dense_layers`: the layers before it are dense
    # Of each layer's parameters (dense and MoE layers alike), those every tp rank holds whole:
    # multi-head latent attention's down-projections and their norms.
    layer_replicated: int = 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def body_dense(self) -> int:
        """Every layer's parameters outside the routed experts (what tp splits)."""
        return self.num_dense_layers * self.layer_dense + self.num_moe_layers * self.moe_layer_dense

    @property
    def body_experts(self) -> int:
        """Every MoE layer's routed experts."""
        return self.num_moe_layers * self.moe_layer_experts

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + self.body_dense + self.body_experts

    @property
    def active(self) -> int:
        """Parameters one token passes through (MoE: only its top-k experts)."""
        return (self.embedding + self.output + self.final_norm
                + self.num_dense_layers * self.layer_dense
                + self.num_moe_layers * self.moe_layer_active)


def mlp_parameters(hidden: int, ffn: int, gated: bool, bias: bool) -> int:
    """One MLP: `h -> ffn (x2 when gated) -> h` [PTD-P eq. 2 counts 8h^2 + 5h for ffn = 4h]."""
    up = ffn * (2 if gated else 1)
    return hidden * up + ffn * hidden + ((up + hidden) if bias else 0)


@dataclass(frozen=True)
class Projection:
    """One attention weight GEMM, `T x k -> T x n`. `split`: how tensor parallelism cuts it:
    "out" its n output columns, "in" its k input rows, None not at all (every tp rank holds it
    whole and runs it on the whole, gathered, sequence)."""

    n: int
    k: int
    split: str | None


def attention_projections(model: ModelConfig) -> tuple[Projection, ...]:
    """The weight GEMMs of one attention layer, as `core.parallel.sharding` shapes them: the
    fused QKV (a + 2 kv heads of `head_dim`) and the output projection; with multi-head latent
    attention (`core.mla_config`) the query down-projection (`q_lora_rank`, when set) and
    per-head up-projection, the kv down-projection to the latent and the shared rotary key
    (`kv_lora_rank + qk_rope_head_dim`), its per-head up-projection to the unrotated keys and
    the values, and the output projection from `v_head_dim` per head."""
    h, a, hd = model.hidden_size, model.num_heads, model.head_dim
    m = model.mla
    if m is None:
        return (Projection((a + 2 * model.num_kv_heads) * hd, h, "out"),
                Projection(h, a * hd, "in"))
    q_down = (Projection(m.q_lora_rank, h, None),) if m.q_lora_rank else ()
    return (*q_down, Projection(a * m.qk_head_dim, m.q_lora_rank or h, "out"),
            Projection(m.cache_dims, h, None),
            Projection(a * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "out"),
            Projection(h, a * m.v_head_dim, "in"))


def attention_head_dims(model: ModelConfig) -> tuple[int, int]:
    """(query and key dims, value dims) of one attention head: `head_dim` twice, or with
    multi-head latent attention `qk_nope_head_dim + qk_rope_head_dim` and `v_head_dim`."""
    if model.mla is not None:
        return model.mla.qk_head_dim, model.mla.v_head_dim
    return model.head_dim, model.head_dim


def parameter_counts(
    model: ModelConfig,
    num_experts: int | None = None,
    experts_per_token: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> ParameterCounts:
    """Parameter counts of `model` by shape, as `core.parallel.sharding.global_param_shapes`
    lays the weights out (fused QKV with kv heads, biases on it alone with `qkv_bias`, gated MLP
    halves, norm biases for layernorm, q/k norms, sandwich norms).

    MoE, from `model.moe` (`moe.num_experts`, `moe.top_k`, `moe.ffn_hidden_size`,
    `moe.shared_ffn_hidden_size`, `moe.layer_freq`, `moe.expert_bias`; the arguments, when
    given, override the first three): every `moe.layer_freq`-th layer (counting from 1) from
    layer `moe.first_dense_layers` on (`core.moe.shapes.is_moe_layer`) replaces its MLP with a
    router (E x h, and an (E,) routing bias with `moe.expert_bias`), E routed experts of FFN
    size `moe.ffn_hidden_size` (no biases, `core.moe.shapes.moe_param_shapes`) and, with
    `moe.shared_ffn_hidden_size` = Fs, a shared expert (a bias-free MLP of FFN size Fs) with,
    when `moe.shared_expert_gated`, its (1, h) sigmoid gate; a token uses `moe.top_k` routed
    experts [Megatron-Core theoretical_memory_usage.py counts routed, active and shared expert
    parameters alike]. The other layers are dense.
    """
    h, hd = model.hidden_size, model.head_dim
    qkv_out = (model.num_heads + 2 * model.num_kv_heads) * hd
    projections = attention_projections(model)
    attn = sum(p.n * p.k for p in projections)
    attn += (qkv_out if model.qkv_bias else 0) + (h if model.bias else 0)
    if model.qk_norm:  # q/k norm weights (core.qk_norm): per head (Qwen3) or projection (OLMo-2)
        attn += (model.num_heads + model.num_kv_heads) * hd if (
            model.qk_norm_width == "projection") else 2 * hd
    # Multi-head latent attention's RMSNorms of the kv (and q) latents, replicated over tp.
    latent_norms = (model.mla.kv_lora_rank + (model.mla.q_lora_rank or 0)) if model.mla else 0
    attn += latent_norms
    replicated = sum(p.n * p.k for p in projections if p.split is None) + latent_norms
    norm = h * (1 if model.norm in ("rmsnorm", "rmsnorm1p") else 2)  # weight, and bias
    # Gemma 2/3's sandwich norms: after the attention in every layer, after a dense MLP too.
    sandwich = model.norm_placement == "sandwich"
    dense_mlp = mlp_parameters(h, model.ffn_hidden_size, model.gated, model.bias)
    E = model.moe.num_experts if num_experts is None else num_experts
    k = model.moe.top_k if experts_per_token is None else experts_per_token
    moe: dict[str, int] = {}
    if E:
        f = moe_ffn_hidden_size or model.moe.ffn_hidden_size or model.ffn_hidden_size
        expert = mlp_parameters(h, f, model.gated, False)
        fs = model.moe.shared_ffn_hidden_size
        gate = h if model.moe.shared_expert_gated else 0
        shared = (mlp_parameters(h, fs, model.gated, False) + gate) if fs else 0
        router = h * E + (E if model.moe.expert_bias else 0)
        moe_dense = attn + (3 if sandwich else 2) * norm + router + shared
        # The layers `core.moe.shapes.is_moe_layer` makes MoE, also when `num_experts` is given
        # here for a dense `model`.
        m = model.moe
        num_moe = sum(1 for i in range(m.first_dense_layers, model.num_layers)
                      if (i + 1) % m.layer_freq == 0)
        moe = dict(num_moe_layers=num_moe, moe_layer_freq=model.moe.layer_freq,
                   moe_first_layer=model.moe.first_dense_layers,
                   moe_layer_dense=moe_dense, moe_layer_experts=E * expert,
                   moe_layer_active=moe_dense + k * expert)
    embedding = model.vocab_size * h + (model.max_position_embeddings * h
                                        if model.position == "learned" else 0)
    output = 0 if model.tied_embeddings else model.vocab_size * h
    return ParameterCounts(embedding=embedding, word_embedding=model.vocab_size * h,
                           output=output, final_norm=norm,
                           layer_dense=attn + (4 if sandwich else 2) * norm + dense_mlp,
                           num_layers=model.num_layers, layer_replicated=replicated, **moe)


def max_stage_moe_layers(counts: ParameterCounts, pp: int) -> float:
    """MoE layers on the pipeline stage holding the most of them, stages taking contiguous
    blocks of L/p layers (`core.parallel.sharding.stage_layers`) and layer i being MoE when
    i >= `moe_first_layer` and (i + 1) % freq == 0, counted stage by stage.
    When every stage holds as many (all layers alike, or freq dividing L/p) this is the
    average `num_moe_layers / p`, returned as that float. Virtual stages (interleaving) are
    not modelled: a rank is taken to hold one contiguous block."""
    m, L, freq = counts.num_moe_layers, counts.num_layers, counts.moe_layer_freq
    per_stage = L // pp
    if m in (0, L) or (per_stage % freq == 0 and counts.moe_first_layer == 0):
        return m / pp
    return float(max(sum(1 for i in range(j * per_stage, (j + 1) * per_stage)
                         if i >= counts.moe_first_layer and (i + 1) % freq == 0)
                     for j in range(pp)))


def expert_params_per_rank(counts: ParameterCounts, pp: int, ep: int = 1, etp: int = 1
                           ) -> float:
    """Routed-expert parameters one rank holds: the MoE layers of the stage holding the most
    (`max_stage_moe_layers`), their experts split over the ep x etp expert grid
    (`num_experts / ep` experts, each FFN sliced over etp), as `core.moe.layer` builds them;
    replicated over tp when ep x etp = 1 (Megatron-Core theoretical_memory_usage.py likewise
    divides routed experts by the expert grid, not tp)."""
    return max_stage_moe_layers(counts, pp) * counts.moe_layer_experts / (ep * etp)


def params_per_rank(counts: ParameterCounts, tp: int, pp: int, ep: int = 1, etp: int = 1
                    ) -> int:
    """Parameters held by the most loaded rank [PTD-P section 2: tensor parallelism splits every
    layer's weights over t ranks, pipeline parallelism gives each rank L/p layers].

    The first pipeline rank holds the embedding, the last the output projection (with tied
    embeddings and p > 1 both hold a copy, as Megatron does); norms are replicated over tp
    and counted whole (slightly pessimistic). A layer's non-routed parameters split over tp
    (the shared expert as the dense MLP; the router and the shared expert's gate, replicated
    in Tessera, are counted split too: (E + 1) h per layer, negligible). With dense and MoE
    layers mixed the body is that of the stage holding the most MoE layers
    (`max_stage_moe_layers`), and that stage is given the larger end (embedding or output): an
    upper bound, exact when the heaviest stage is an end stage. Routed experts split over the
    expert grid (`expert_params_per_rank`), not over tp; multi-head latent attention's
    down-projections (`layer_replicated`) are whole on every tp rank."""
    layers = counts.num_layers / pp
    moe = max_stage_moe_layers(counts, pp)
    per_layer = (counts.body_dense / counts.num_layers if moe * pp == counts.num_moe_layers
                 else ((layers - moe) * counts.layer_dense + moe * counts.moe_layer_dense)
                 / layers)  # the first form is exact when all stages are alike
    whole = counts.layer_replicated * (1 - 1 / tp)  # what every tp rank holds in full
    body = layers * (per_layer / tp + whole) + expert_params_per_rank(counts, pp, ep, etp)
    emb = counts.embedding / tp
    out = (counts.output or (counts.word_embedding if pp > 1 else 0)) / tp
    if pp == 1:
        return round(body + emb + out + counts.final_norm)
    return round(body + max(emb, out + counts.final_norm))


# --- weights, gradients, optimizer ---------------------------------------------------------

# Mixed-precision Adam [ZeRO section 3.1]: 16-bit weights (2 bytes), fp32 gradients kept for
# accumulation as Megatron's main grads (4), fp32 master weights, momentum and variance (12).
WEIGHT_BYTES = 2
GRAD_BYTES = 4
OPTIMIZER_BYTES = 12


def model_state_bytes(params: float, dp: int = 1, sharded_optimizer: bool = False,
                      precision: str = "bf16") -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes for `params` parameters on one rank:
    2 + 4 + 12 = 18 bytes per parameter, or 6 + 12/dp with the optimizer states sharded over
    the data-parallel group (ZeRO stage 1 / Megatron's distributed optimizer) [ZeRO 5.1].
    In plain fp32 (CPU runs) there is no master copy: 4 + 4 + 8 (Adam's two moments)."""
    weight, grad, opt = (4, 4, 8) if precision == "fp32" else (
        WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)
    return weight * params, grad * params, opt * params / (dp if sharded_optimizer else 1)


def optimizer_state_bytes(dense_params: float, expert_params: float, dp_cp: int, edp: int,
                          sharded_optimizer: bool, bytes_per_param: float = OPTIMIZER_BYTES
                          ) -> float:
    """Optimizer-state bytes on one rank holding `dense_params` dense and `expert_params`
    routed-expert parameters. Unsharded: `bytes_per_param` for each. Sharded (ZeRO stage 1
    [ZeRO 5.1]): each parameter's state is split over the group its gradient is reduced over,
    as Megatron-Core's distributed optimizer does (one shard per data-parallel group: the
    dense buffers over dp x cp, the expert buffers over the expert-data-parallel group) and as
    Tessera's zero1 does (`core.parallel.data_parallel.build_zero_optimizer`, `experts=`):
    `dense / (dp cp) + expert / edp`, with `edp = t cp dp / (ep etp)`
    (`core.parallel.expert_groups.edp_size`). Callers pass `edp = dp_cp` when ep x etp = 1
    (the experts are then plain replicated parameters)."""
    b = bytes_per_param
    if not sharded_optimizer:
        return b * dense_params + b * expert_params
    return b * dense_params / dp_cp + b * expert_params / edp


# --- activations ---------------------------------------------------------------------------


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                 sequence_parallel: bool = False,
                                 recompute: str = "none") -> float:
    """Activation bytes of one transformer layer [Korthikanti Table 2]:

    | no parallelism                | s b h (34 + 5 a s / h)                |
    | tensor parallel               | s b h (10 + 24/t + 5 a s / (h t))     |
    | tensor + sequence parallel    | s b h / t (34 + 5 a s / h)            |
    | tensor parallel + selective   | s b h (10 + 24/t)                     |
    | tensor + sequence + selective | s b h 34 / t                          |
    | full recomputation            | 2 s b h (2 s b h / t with sequence parallel) |

    `t = 1` gives the no-parallelism row.
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's stored activations in bytes per (s b h) unit split by how tp shards them:
    `replicated` stays whole without sequence parallelism (norm inputs, dropout masks, the
    inputs of the column-parallel GEMMs), `split` is always divided by t (per-head and per-FFN
    tensors), `scores` is the attention-score term's coefficient of `a s / h` (softmax output,
    its dropout mask and output: 5 a s^2 b, none with a fused attention kernel)."""

    replicated: float
    split: float
    scores: float
    whole: float = 0.0  # kept for the whole sequence on every tp rank, sequence parallel or not


def layer_activation_units(model: ModelConfig, flash_attention: bool = False,
                           ffn: int | None = None) -> LayerActivations:
    """Korthikanti's per-layer count [section 4.1] for any `ModelConfig`:

    replicated 10 = two norm inputs (4) + QKV input (2) + MLP input (2) + two dropout masks (2);
    split 24 = Q, K (4) + V (2) + projection input (2) + the MLP's activation input and output
    (2 ffn/h each, 16 at ffn = 4h). With grouped-query attention K and V shrink to kv/a of Q;
    a gated MLP also stores its two halves (6 ffn/h in all). A fused (flash) attention kernel
    keeps no s^2 scores but its output's softmax statistics (negligible). `ffn`: the FFN size
    of the tp-split MLP (default `ffn_hidden_size`; an MoE layer's shared expert, 0 for none).

    Multi-head latent attention: Q and K of `qk_head_dim`, V and the projection input of
    `v_head_dim` per head (split); each latent's norm input and normed output (2 + 2 units of
    `kv_lora_rank / h`, and of `q_lora_rank / h` when set) are computed from the gathered
    sequence by replicated weights, so every tp rank keeps them whole (`whole`)."""
    h, a, kv = model.hidden_size, model.num_heads, model.num_kv_heads
    qk, v = attention_head_dims(model)
    mlp = (6 if model.gated else 4) * (model.ffn_hidden_size if ffn is None else ffn) / h
    split = 2 * a * qk / h + 2 * kv * qk / h + 2 * kv * v / h + 2 * a * v / h + mlp
    whole = (4 * (model.mla.kv_lora_rank + (model.mla.q_lora_rank or 0)) / h
             if model.mla is not None else 0.0)
    return LayerActivations(replicated=10.0, split=split, scores=0.0 if flash_attention else 5.0,
                            whole=whole)


def layer_activation_bytes(model: ModelConfig, s: int, b: int, t: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           cp: int = 1, flash_attention: bool = False,
                           units: LayerActivations | None = None) -> float:
    """Stored activation bytes of one layer on one rank, [Korthikanti Table 2] generalised by
    `layer_activation_units`; context parallelism divides the sequence a rank holds by `cp`
    (and the score matrix by cp as well: each rank scores its s/cp queries against s keys).
    Full recomputation keeps only the layer input, 2 s b h (/t with sequence parallelism).
    `units`: `layer_activation_units(model, flash_attention)`, when the caller has it."""
    sl = s / cp
    sbh = sl * b * model.hidden_size
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    u = units or layer_activation_units(model, flash_attention)
    scores = 0.0 if recompute == "selective" else u.scores * model.num_heads * s / model.hidden_size
    replicated = u.replicated / (t if sequence_parallel else 1)
    return sbh * (replicated + u.whole + (u.split + scores) / t)


def moe_layer_activation_bytes(model: ModelConfig, s: int, b: int, t: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               cp: int = 1, flash_attention: bool = False, etp: int = 1
                               ) -> float:
    """Stored activation bytes of one MoE layer on one rank, counted Korthikanti's way
    [Korthikanti section 4.1: every tensor a backward needs, 2 bytes an element] over the
    tensors Tessera's MoE layer keeps for its backward (`core.moe.layer`, `core.moe.permute`,
    `core.moe.experts`; Megatron-Core's MoE layer keeps the same set: its `moe_layer`
    permute, grouped GEMMs and unpermute):

    - attention, the norms, the MLP input and the dropout masks as a dense layer
      (`layer_activation_bytes`), the dense MLP replaced by the shared expert when there is one
      (an MLP of `moe.shared_ffn_hidden_size`, split over tp like the dense MLP: its
      `6 Fs/h` or `4 Fs/h` units) plus the shared expert's output that its gate multiplies,
      `2 s b h` (split over t with sequence parallelism);
    - for the n tokens the rank routes (`s b / cp`, divided by t under sequence parallelism;
      at ep x etp = 1 without it every tp rank routes all of them): the router's fp32 scores
      `4 E` bytes a token; and per routed copy (k a token): the permuted input, `2 h` bytes
      (x etp after the expert-tensor-parallel all-gather), the expert FFN intermediate of
      `6 f` bytes gated (`[gate; up]` and the activation output) or `4 f` (slices of f/etp on
      etp x the copies: the same total), and the expert output the unpermute weighs, `2 h`.

    Full recomputation keeps only the layer input, as a dense layer.

    Tessera's own layer keeps somewhat more today (measured with
    `torch.autograd.graph.saved_tensors_hooks` on `qwen-moe-tiny` / `mixtral-tiny` in bf16,
    128 tokens, fused SwiGLU: the MoE block saves 331 / 344 kB against the 250 / 281 kB counted
    here; eager SwiGLU also keeps `silu(gate)`, 2 f bytes a copy): an
    fp32 copy of the router input (4 h bytes a token), a third h-sized copy per routed token
    (the weighted expert output `index_add` keeps), the int64 routing indices and the load
    balancing loss's own copy of the scores. Those are implementation details a fused
    permute/unpermute drops (Megatron-Core's), not counted here."""
    if recompute == "full":
        return layer_activation_bytes(model, s, b, t, sequence_parallel, recompute, cp)
    h = model.hidden_size
    fs = model.moe.shared_ffn_hidden_size
    units = layer_activation_units(model, flash_attention, ffn=fs)
    split_by = t if sequence_parallel else 1
    local = s / cp * b  # tokens of this rank's micro-batch
    base = layer_activation_bytes(model, s, b, t, sequence_parallel, recompute, cp,
                                  flash_attention, units)
    shared_out = 2 * local * h / split_by if fs else 0.0
    n = local / split_by
    f = model.moe.ffn_hidden_size or model.ffn_hidden_size
    per_copy = 2 * h * etp + (6 if model.gated else 4) * f + 2 * h
    routed = n * (4 * model.moe.num_experts + model.moe.top_k * per_copy)
    return base + shared_out + routed



# --- MoE routing and token dispatch (memory-bound work the FLOPs formula leaves out) --------


def moe_dispatch_bytes(tokens: float, h: int, experts_per_token: int, local_experts: int,
                       etp: int = 1, dtype_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one MoE layer's token permutation on one rank, as
    Megatron-Core's all-to-all dispatcher runs it (v0.9, the release behind its "468 TFLOPS"
    Mixtral 8x7B figure: `moe_utils.permute` / `unpermute` over `moe_gather` / `moe_scatter`,
    `sort_chunks_by_idxs`), each kernel reading each of its input tensors and writing its
    output once (a broadcast input read once; index tensors and the (n, k) probabilities
    left out). With `n = tokens` the rank routes, `c = n k` routed copies and a row of
    `h x dtype_bytes` bytes, in rows:

    forward, `8 c + 2 n`
    - permute, a gather of each token's k copies into expert order: read n, write c;
    - unpermute: a zeroed c-row buffer (write c) the expert outputs are scatter-added into
      (read the buffer and the outputs, write the buffer: 3 c), weighted by the router
      probabilities (read c, write c), each token's k copies summed (read c, write n);
    backward (PyTorch's autograd for the same ops, Megatron's `moe_gather` / `moe_scatter`
    backward are the same kernels), `7 c + 5 n`
    - the weighting: the probabilities' gradient, the broadcast output gradient times the
      saved copies (read n + c, write c) summed over h (read c); the copies' gradient, the
      output gradient times the probabilities (read n, write c);
    - the scatter's backward, a gather: read c, write c;
    - the permute's backward, a scatter-add of the c copy gradients into a zeroed n-row
      buffer: write n, then read n + c, write n.

    With more than one local expert (`num_experts / ep > 1`) the received copies (`etp` x c
    after the expert-tensor-parallel all-gather) are also sorted by local expert before the
    expert GEMMs and back after, a concatenation each (read and write; its backward another):
    `4 etp c` rows more each way. With one expert per rank Megatron skips that step (MoE
    README: when "EP size increased to the number of expert, the local token permutation/
    un-permutation for experts computation are omitted"). Megatron's later fused permute
    (`--moe-permute-fusion`) moves less; not modelled. Checked against PyTorch's own kernels
    (tests/unit/plan/test_moe_costs.py counts the bytes of every op autograd runs)."""
    n, c = tokens, tokens * experts_per_token
    sort = 4 * etp * c if local_experts > 1 else 0
    row = h * dtype_bytes
    return (8 * c + 2 * n + sort) * row, (7 * c + 5 * n + sort) * row


def moe_router_flops(tokens: float, h: int, num_experts: int) -> float:
    """Forward FLOPs of the router's gating GEMM, `2 n h E` (its backward twice that).
    Megatron-LM's `num_floating_point_operations` leaves the router out of the model FLOPs
    behind MFU, so this is time the planner charges, not FLOPs it credits."""
    return 2 * tokens * h * num_experts


def moe_router_bytes(tokens: float, h: int, num_experts: int, dtype_bytes: int = 2
                     ) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one MoE layer's routing on one rank (Megatron-Core
    v0.9 `TopKRouter` with `aux_loss` balancing: `topk_softmax_with_capacity`,
    `switch_load_balancing_loss_func`), per token, each kernel reading its inputs and writing
    its outputs once as `moe_dispatch_bytes` counts (d = `dtype_bytes`, E = `num_experts`;
    the O(k) top-k values, indices and counts and the E x h weight left out):

    - forward, `h d + 3 E d + 8 E`: the gating GEMM reads the token (h d) and writes its
      logits (E d); top-k reads them (E d); the load-balancing loss's softmax reads them
      (E d) and writes fp32 scores (4 E, `dtype=float32` converts inside the CUDA kernel),
      which its per-expert sum reads (4 E);
    - backward, `2 h d + 9 E d + 4 E`: the softmax backward reads its saved scores (4 E; the
      gradient is a broadcast row) and writes the logits' gradient (E d); top-k's backward
      scatters into a zeroed logits row (write E d, read E d, write E d); the two gradients
      are added (read 2 E d, write E d); the GEMM's input gradient reads them and writes
      the token's (E d + h d), its weight gradient reads them and the token (E d + h d)."""
    d, E = dtype_bytes, num_experts
    return tokens * (h * d + 3 * E * d + 8 * E), tokens * (2 * h * d + 9 * E * d + 4 * E)


def moe_routed_row_bytes(tokens: float, h: int, experts_per_token: int, etp: int = 1
                         ) -> float:
    """The h-sized per-copy tensors among an MoE layer's stored activations
    (`moe_layer_activation_bytes`: the permuted input, `etp` x after the expert-tensor-parallel
    gather, and the expert output, 2 bytes an element): `2 h (etp + 1)` bytes a routed copy.
    The permutation kernels write and read them (`moe_dispatch_bytes`), so a time model that
    charges one memory-bound pass over the stored activations and also the dispatch leaves
    these out of the former."""
    return tokens * experts_per_token * 2 * h * (etp + 1)

def inflight_microbatches(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro-batches of a stage's activations the first pipeline rank holds at its peak, in
    units of one micro-batch through all L/p of its layers [Korthikanti section 4.2.3]:
    1F1B keeps p in flight (so the first stage stores L layers' worth in all), the interleaved
    schedule p (1 + (p - 1)/(p v)); with fewer micro-batches than stages, only m."""
    if pp == 1:
        return 1.0
    factor = pp * (1 + (pp - 1) / (pp * virtual_stages)) if virtual_stages > 1 else float(pp)
    return factor * min(1.0, micro_batches / pp)


def embedding_activation_bytes(s: int, b: int, h: int, t: int = 1) -> float:
    """Embedding input ids and dropout [Megatron-LM theoretical_memory_usage.py]: `8 s b`
    (int64 ids) + `s b h` (dropout mask), on the first stage, divided by t."""
    return (8 * s * b + s * b * h) / t


def logits_activation_bytes(s: int, b: int, h: int, vocab: int, t: int = 1) -> float:
    """Output layer and cross-entropy on the last stage [Megatron-LM theoretical_memory_usage.py,
    after Korthikanti 4.2.2]: `4 s b h (1 + V/h)` / t (its input and the fp32 logits)."""
    return 4 * s * b * h * (1 + vocab / h) / t


def embedding_backward_bytes(vocab: int, h: int, t: int = 1, grad_bytes: int = 2,
                             main_grad_bytes: int = 4) -> float:
    """HBM bytes the first stage's word-embedding backward moves per micro-batch, memory bound:
    the embedding gradient is dense (`torch.nn.functional.embedding`, `sparse=False`, as
    Megatron's `VocabParallelEmbedding` calls it), a whole `V/t x h` table written in the
    activation dtype, then read and added into the fp32 main gradient (Megatron-LM
    `DistributedDataParallel`'s gradient hook, `main_grad.add_(grad)`):
    `V h/t * 2 (grad_bytes + main_grad_bytes)`. The forward is a gather of `s b` rows, small."""
    return vocab / t * h * 2 * (grad_bytes + main_grad_bytes)


# --- FLOPs ---------------------------------------------------------------------------------


def ptdp_flops_per_iteration(B: int, s: int, L: int, h: int, V: int,
                             recompute: str = "full") -> float:
    """FLOPs of one iteration [PTD-P eq. 3, Korthikanti section 6]:

    - full recompute: `96 B s L h^2 (1 + s/(6h) + V/(16 L h))` (forward twice, backward once);
    - none (the *model* FLOPs behind MFU): `72 B s L h^2 (1 + s/(6h) + V/(12 L h))`;
    - selective: none plus the attention scores' forward again, `4 B s^2 h` per layer:
      `72 B s L h^2 (1 + 2s/(9h) + V/(12 L h))`.
    """
    if recompute == "full":
        return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    if recompute == "selective":
        return 72 * B * s * L * h**2 * (1 + 2 * s / (9 * h) + V / (12 * L * h))
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer for `tokens` tokens: `dense` (the four weight GEMMs, with MoE
    the active experts), `attention` (Q K^T and scores x V)."""

    dense: float
    attention: float

    @property
    def total(self) -> float:
        return self.dense + self.attention


def layer_forward_flops(model: ModelConfig, tokens: float, s: int, active_mlp_params: float
                        | None = None) -> LayerFlops:
    """Forward FLOPs of one layer [PTD-P section 5.1: 24 B s h^2 + 4 B s^2 h for GPT]:
    2 FLOPs per multiply-add over the attention projections (`attention_projections`), and
    the MLP weights (`active_mlp_params` with MoE) and `2 s a (d_qk + d_v)` per token for the
    two attention batched GEMMs over the full sequence, `4 s a d` when the head dims are equal
    (Megatron counts causal attention in full, as here)."""
    h = model.hidden_size
    qk, v = attention_head_dims(model)
    attn_w = sum(p.n * p.k for p in attention_projections(model))
    mlp_w = (active_mlp_params if active_mlp_params is not None
             else model.ffn_hidden_size * h * (3 if model.gated else 2))
    return LayerFlops(dense=2 * tokens * (attn_w + mlp_w),
                      attention=2 * tokens * s * model.num_heads * (qk + v))


def moe_active_mlp_weights(model: ModelConfig) -> int:
    """MLP weights one token multiplies by in an MoE layer: `moe.top_k` routed experts and the
    shared expert, each `(2 if gated else 1) f h + f h` (no biases; `core.moe.shapes`). The
    router's (E x h) and the gate's (1 x h) logits are left out, as Megatron-LM's
    `num_floating_point_operations` leaves out the router."""
    up = 3 if model.gated else 2
    f = model.moe.ffn_hidden_size or model.ffn_hidden_size
    return up * model.hidden_size * (model.moe.top_k * f + model.moe.shared_ffn_hidden_size)


def logits_forward_flops(tokens: float, h: int, vocab: int) -> float:
    """Forward FLOPs of the output projection [PTD-P section 5.1]: `2 B s h V`."""
    return 2 * tokens * h * vocab


def training_days_ptdp(tokens: float, params: float, gpus: int, tflops_per_gpu: float) -> float:
    """End-to-end training time [PTD-P eq. 4]: `8 T P / (n X)` seconds, in days."""
    return 8 * tokens * params / (gpus * tflops_per_gpu * 1e12) / 86400


# --- pipeline ------------------------------------------------------------------------------


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble over ideal time [PTD-P section 2.2]: `(p - 1)/m` for GPipe and 1F1B,
    `(p - 1)/(v m)` for the interleaved schedule with v chunks per rank."""
    return (pp - 1) / (virtual_stages * micro_batches)


# --- communication volumes (bytes each rank sends) -----------------------------------------


def allreduce_bytes(size: float, n: int) -> float:
    """Ring all-reduce of a `size`-byte buffer over n ranks [Ring]: `2 (n - 1)/n * size`."""
    return 2 * (n - 1) / n * size


def allgather_bytes(size: float, n: int) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is `size` bytes [Ring]:
    `(n - 1)/n * size`."""
    return (n - 1) / n * size


def tp_layer_comm_bytes(s: int, b: int, h: int, t: int, sequence_parallel: bool,
                        dtype_bytes: int = 2) -> float:
    """Bytes one rank sends for one layer's forward [PTD-P section 3.2 / Korthikanti
    section 4.2.2]: two all-reduces of the `s b h` activations (after attention and after the
    MLP), or with sequence parallelism two all-gathers and two reduce-scatters, which move the
    same bytes. The backward moves as much again; a full recompute repeats the forward's."""
    size = s * b * h * dtype_bytes
    if t == 1:
        return 0.0
    if sequence_parallel:
        return 2 * (allgather_bytes(size, t) + allgather_bytes(size, t))
    return 2 * allreduce_bytes(size, t)


def pp_p2p_bytes(s: int, b: int, h: int, t: int = 1, sequence_parallel: bool = False,
                 dtype_bytes: int = 2) -> float:
    """Bytes one stage boundary sends per micro-batch in one direction [PTD-P section 4.1]:
    `s b h`, divided by t with the scatter/gather optimisation or sequence parallelism (each
    tp rank sends its slice)."""
    return s * b * h * dtype_bytes / t


def pp_gather_bytes(s: int, b: int, h: int, t: int = 1, sequence_parallel: bool = False,
                    dtype_bytes: int = 2) -> float:
    """Bytes each receiving rank moves over NVLink per stage boundary to undo the scatter/gather
    optimisation [PTD-P section 4.1, Fig. 9]: the sender splits the replicated `s b h` output
    into t slices, each tp rank sends one over InfiniBand, and the receivers all-gather them
    over NVLink, `(t - 1)/t * s b h` bytes, before the next stage can start. With sequence
    parallelism the activations stay split (Korthikanti section 4.2.2): nothing to gather."""
    if t == 1 or sequence_parallel:
        return 0.0
    return allgather_bytes(s * b * h * dtype_bytes, t)


def pipeline_critical_transfers(pp: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Point-to-point transfers on one pipeline rank's critical path per step [PTD-P sections
    2.2 and 4.1]: in the steady state each model chunk of each micro-batch sends its
    activations forward and its input gradient backward, `2 v m`, v times 1F1B's (the
    interleaved schedule's "v-times more communication"), waited for rather than overlapped
    (the 2021 implementation blocks on each batched send/receive); plus the fill and drain, in
    which the first micro-batch's forward crosses the p - 1 boundaries before the last rank
    starts and the last backward crosses them back, `2 (p - 1)`. 0 when `pp == 1`."""
    if pp <= 1:
        return 0
    return 2 * virtual_stages * micro_batches + 2 * (pp - 1)


def embedding_grad_sync_bytes(vocab: int, h: int, t: int = 1, grad_bytes: int = 2) -> float:
    """Bytes each rank sends to keep tied input and output embeddings equal when they sit on
    different pipeline stages (pp > 1) [Megatron-LM `_allreduce_word_embedding_grads`,
    run after the data-parallel reduction; Shoeybi et al. 2019 tie the two]: an all-reduce of
    the `V/t x h` word-embedding gradient between the first and last stage, two ranks,
    `2 (2 - 1)/2 * V h/t * grad_bytes`."""
    return allreduce_bytes(vocab / t * h * grad_bytes, 2)


def dp_grad_bytes(params: float, n: int, grad_bytes: int = 2) -> float:
    """Gradient all-reduce per rank per step over the n data-parallel ranks [Ring]:
    `2 (n - 1)/n * params * grad_bytes`; a sharded optimizer's reduce-scatter of gradients and
    all-gather of weights move the same bytes [ZeRO section 7.2.1]."""
    return allreduce_bytes(params * grad_bytes, n)


def cp_layer_comm_bytes(s: int, b: int, kv_heads: int, head_dim: int, cp: int,
                        dtype_bytes: int = 2) -> float:
    """Bytes one rank receives per layer forward under context parallelism [Megatron-Core
    context_parallel.md; Liu et al., Ring Attention, arXiv 2310.01889]: every rank needs all
    K and V, `2 s b kv d` bytes x 2, of which it lacks (cp - 1)/cp; the backward
    reduce-scatters dK and dV, the same again."""
    return allgather_bytes(2 * s * b * kv_heads * head_dim * dtype_bytes, cp)


def etp_layer_comm_bytes(tokens: float, h: int, experts_per_token: int, etp: int,
                         dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per MoE layer forward for expert tensor parallelism
    [Megatron-Core MoE all-to-all dispatcher; `core.parallel.expert_parallel`]: after the ep
    exchange a rank holds its `tokens` x top-k copies; it all-gathers its etp peers' copies
    before the experts and reduce-scatters the partial outputs after, each
    `(etp - 1)/etp` of the `etp` x larger gathered buffer [Ring]."""
    return 2 * allgather_bytes(etp * tokens * experts_per_token * h * dtype_bytes, etp)


def ep_layer_comm_bytes(tokens: float, h: int, experts_per_token: int, ep: int,
                        dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per MoE layer forward under expert parallelism [Lepikhin et al.,
    GShard, arXiv 2006.16668; Megatron-Core MoE all-to-all dispatcher]: dispatch and combine
    all-to-alls of its tokens' top-k copies, of which (ep - 1)/ep leave the rank."""
    return 2 * tokens * experts_per_token * h * dtype_bytes * (ep - 1) / ep


# --- serving -------------------------------------------------------------------------------


def kv_cache_bytes(model: ModelConfig, tokens: int, dtype_bytes: float = 2) -> float:
    """KV cache of `tokens` tokens (batch x context): `2 L kv d` values per token [Pope et al.,
    "Efficiently Scaling Transformer Inference", arXiv 2211.05102, section 2]; with multi-head
    latent attention the latent and the shared rotary key, `L (kv_lora_rank +
    qk_rope_head_dim)` (`MLAConfig.cache_dims`)."""
    if model.mla is not None:
        return model.num_layers * model.mla.cache_dims * tokens * dtype_bytes
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * tokens * dtype_bytes


def kv_cache_tp_copies(model: ModelConfig, tp: int) -> int:
    """How many copies of the KV cache `tp` ranks hold together (`core.parallel.sharding.
    kv_geometry`): 1 when they split the kv heads, tp / kv when kv heads are replicated, tp
    with multi-head latent attention (the latent is whole on every rank)."""
    if model.mla is not None:
        return tp
    return max(1, tp // model.num_kv_heads)


def kv_cache_bytes_per_rank(model: ModelConfig, tokens: int, tp: int, pp: int = 1,
                            dtype_bytes: float = 2) -> float:
    """KV cache of `tokens` tokens on one rank of a tp x pp replica (L/p layers each)."""
    return kv_cache_bytes(model, tokens, dtype_bytes) * kv_cache_tp_copies(model, tp) / (tp * pp)
