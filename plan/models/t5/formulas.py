"""The planner's formulas for T5 (encoder-decoder): small pure functions, each citing its source.

Sources:
- [T5] Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
  Transformer", JMLR 2020, arXiv 1910.10683: the architecture (section 3.1.1: an encoder of
  self-attention + MLP blocks, a decoder adding attention over the encoder output, pre-norm
  without bias, a relative position bias of one scalar per head and bucket, computed by the
  first layer of each stack and shared), span corruption (section 3.1.4). T5 v1.1 (the
  released `t5v1_1` checkpoints) uses the gated-GELU MLP and an output layer of its own.
- [Megatron-T5] Megatron-LM `megatron/core/models/T5/t5_model.py` and
  `megatron/core/pipeline_parallel` (`pipeline_model_parallel_split_rank`): tensor-parallel
  T5 splits attention heads and the MLP as GPT's layers; pipeline stages hold encoder layers
  up to a split rank and decoder layers after it, the encoder output travelling with the
  decoder's hidden states.
- [PTD-P] Narayanan et al. 2021 and [Korthikanti] Korthikanti et al. 2022 for the terms the
  decoder-only formulas already use (`plan.formulas`): 2 FLOPs per multiply-add, backward =
  2 x forward, attention counted in full, activation bytes per stored tensor.

Notation: h hidden, a heads, d head dim, f FFN size, V vocabulary, b micro-batch, `s_e` encoder
length (`--seq-len`), `s_d` decoder length (`t5_decoder_length`), t tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.core.config import ModelConfig
from tessera.core.models.t5.layout import decoder_layers, t5_stage_layers
from tessera.core.models.t5.span import fit_raw_length
from tessera.plan import formulas as F


def t5_decoder_length(seq_len: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Decoder tokens per sample for `seq_len` encoder tokens, as Tessera's span-corruption data
    makes them [T5 section 3.1.4; `core.models.t5.span`, which `training.t5_data` uses]: the longest
    target (a sentinel per span, the noise tokens, EOS) of the longest raw window whose
    corrupted input fits `seq_len`, at 15% noise and mean span 3; with sequence parallelism
    padded up to a multiple of tp (`training.t5_objective.PaddedTargets`). 116 for 512."""
    n = fit_raw_length(seq_len).target_length
    if sequence_parallel and tp > 1:
        n = -(-n // tp) * tp
    return n


def attention_weights(model: ModelConfig) -> int:
    """Weights of one attention block, self or cross: `[q; k; v]` (h x 3 a d) and the output
    (a d x h), no biases [T5 section 3.1.1; cross-attention's q and `[k; v]` are the same sizes]."""
    return 4 * model.hidden_size * model.num_heads * model.head_dim


@dataclass(frozen=True)
class T5ParameterCounts:
    """Parameters of a T5 by where they live [T5 section 3.1.1; v1.1's untied output]:
    one embedding (V h) shared by both stacks; an encoder layer (self-attention, MLP, two
    RMSNorm weights h), a decoder layer (self- and cross-attention, MLP, three norms); each
    stack's relative position bias (buckets x a, held by its layer 0) and final norm; the
    output projection (V h, 0 when tied)."""

    embedding: int
    output: int
    encoder_layer: int
    decoder_layer: int
    relative_bias: int  # one stack's
    final_norm: int  # one stack's
    num_encoder_layers: int
    num_decoder_layers: int

    @property
    def total(self) -> int:
        return (self.embedding + self.output + 2 * (self.relative_bias + self.final_norm)
                + self.num_encoder_layers * self.encoder_layer
                + self.num_decoder_layers * self.decoder_layer)


def t5_parameter_counts(model: ModelConfig) -> T5ParameterCounts:
    """`T5ParameterCounts` of `model` (family "t5"): attention 4 h a d per block, the MLP
    `F.mlp_parameters` (gated GELU: h x 2f and f x h; ReLU: h x f and f x h), RMSNorm h."""
    h = model.hidden_size
    attn = attention_weights(model)
    mlp = F.mlp_parameters(h, model.ffn_hidden_size, model.gated, False)
    return T5ParameterCounts(
        embedding=model.vocab_size * h,
        output=0 if model.tied_embeddings else model.vocab_size * h,
        encoder_layer=attn + mlp + 2 * h, decoder_layer=2 * attn + mlp + 3 * h,
        relative_bias=model.options.relative_attention_num_buckets * model.num_heads, final_norm=h,
        num_encoder_layers=model.num_layers, num_decoder_layers=decoder_layers(model))


def t5_stage_parameters(model: ModelConfig, pp: int, tp: int = 1) -> list[float]:
    """Parameters one tensor-parallel rank of each pipeline stage holds, as `core.models.t5.model` places
    them (`core.models.t5.layout.t5_stage_layers` for the layers; [Megatron-T5] the same split):
    stage 0 the embedding and its encoder layers, the stack holding layer 0 its relative bias,
    the last encoder stage the encoder norm, the first decoder stage a copy of the embedding
    (one table when pp = 1), the last stage the decoder norm and the output (with tied
    embeddings a copy of the embedding there too). tp splits the layers' weights, the embedding
    and output rows and the bias's heads; the norms are replicated."""
    c = t5_parameter_counts(model)
    h = model.hidden_size
    norms_enc, norms_dec = 2 * h, 3 * h
    out = []
    for stage in range(pp):
        enc, dec = t5_stage_layers(stage, pp, model)
        n = (len(enc) * ((c.encoder_layer - norms_enc) / tp + norms_enc)
             + len(dec) * ((c.decoder_layer - norms_dec) / tp + norms_dec))
        n += c.relative_bias / tp * ((0 in enc) + (0 in dec))
        n += c.final_norm * ((model.num_layers - 1 in enc) + (c.num_decoder_layers - 1 in dec))
        first_dec = len(dec) and dec.start == 0
        last = stage == pp - 1
        if stage == 0 or (first_dec and pp > 1) or (last and c.output == 0 and pp > 1):
            n += c.embedding / tp
        if last:
            n += c.output / tp
        out.append(n)
    return out


@dataclass(frozen=True)
class T5LayerFlops:
    """Forward FLOPs of one encoder and one decoder layer over a batch, split into the weight
    GEMMs (`dense`) and the attention batched GEMMs (`attention`)."""

    encoder: F.LayerFlops
    decoder: F.LayerFlops


def t5_layer_forward_flops(model: ModelConfig, samples: float, s_enc: int, s_dec: int
                           ) -> T5LayerFlops:
    """Forward FLOPs of one layer of each stack for `samples` sequences [PTD-P section 5.1's
    counting: 2 per multiply-add, attention `4 s_q s_k a d` per sequence, causal in full;
    T5 section 3.1.1 for what each layer holds]:

    - encoder: `2 T_e (4 h a d + W_mlp)` + `4 T_e s_e a d`, T_e = samples x s_e;
    - decoder: `2 T_d (4 h a d + 2 h a d + W_mlp)` (self-attention, cross q and output) +
      `2 T_e (2 h a d)` (cross k and v over the encoder output) + `4 T_d s_d a d` (self) +
      `4 T_d s_e a d` (cross), T_d = samples x s_d.

    W_mlp = 3 h f gated (v1.1), 2 h f with ReLU."""
    h, ad = model.hidden_size, model.num_heads * model.head_dim
    mlp = model.ffn_hidden_size * h * (3 if model.gated else 2)
    te, td = samples * s_enc, samples * s_dec
    enc = F.LayerFlops(dense=2 * te * (4 * h * ad + mlp), attention=4 * te * s_enc * ad)
    dec = F.LayerFlops(dense=2 * td * (6 * h * ad + mlp) + 2 * te * 2 * h * ad,
                       attention=4 * td * (s_dec + s_enc) * ad)
    return T5LayerFlops(encoder=enc, decoder=dec)


def t5_flops_per_step(model: ModelConfig, global_batch: int, s_enc: int, s_dec: int) -> float:
    """FLOPs of one training step (forward and backward, no recomputation: T5 trains without
    it) [PTD-P eq. 3's accounting: backward = 2 x forward]: `3 (L_e F_enc + L_d F_dec +
    2 B s_d h V)` with `t5_layer_forward_flops` and the output layer over the decoder tokens.
    The relative bias (a table lookup) and the norms are not counted, as PTD-P leaves norms out."""
    lf = t5_layer_forward_flops(model, global_batch, s_enc, s_dec)
    logits = F.logits_forward_flops(global_batch * s_dec, model.hidden_size, model.vocab_size)
    return 3 * (model.num_layers * lf.encoder.total + decoder_layers(model) * lf.decoder.total
                + logits)


def t5_encoder_layer_activation_bytes(model: ModelConfig, s_enc: int, b: int, t: int = 1,
                                      sequence_parallel: bool = False,
                                      flash_attention: bool = False) -> float:
    """Stored activation bytes of one encoder layer on one rank: a decoder-only layer's
    [Korthikanti Table 2 as `formulas.layer_activation_bytes` generalises it] plus the
    additive score bias the attention reads, `2 b (a/t) s_e^2` bytes: T5's learned relative
    bias has a gradient, so even a fused kernel keeps it (`core.models.t5.model` adds the padding mask to it
    per layer, one per batch row)."""
    base = F.layer_activation_bytes(model, s_enc, b, t, sequence_parallel, "none", 1,
                                    flash_attention)
    return base + 2 * b * model.num_heads / t * s_enc**2


def t5_decoder_layer_activation_bytes(model: ModelConfig, s_dec: int, s_enc: int, b: int,
                                      t: int = 1, sequence_parallel: bool = False,
                                      flash_attention: bool = False) -> float:
    """Stored activation bytes of one decoder layer on one rank, Korthikanti's way [section
    4.1: every tensor a backward needs, 2 bytes an element, dropout masks 1]:

    - self-attention and MLP as a decoder-only layer over s_d (`layer_activation_bytes`),
      plus the causal relative bias `2 (a/t) s_d^2` (one for the batch);
    - cross-attention: its norm input, q-projection input (2 + 2) and dropout mask (1) of
      `s_d b h` (split over t with sequence parallelism), q and the output projection's input
      (`2 + 2` of `s_d b a d / t`), k and v over the encoder output (`4 s_e b a d / t`), and
      without a fused kernel the scores' `5 b (a/t) s_d s_e`.

    The encoder output every decoder layer reads is the stage's (`t5_stage_activation_bytes`)."""
    ad = model.num_heads * model.head_dim
    h = model.hidden_size
    base = F.layer_activation_bytes(model, s_dec, b, t, sequence_parallel, "none", 1,
                                    flash_attention)
    bias = 2 * model.num_heads / t * s_dec**2
    cross = (5 * s_dec * b * h / (t if sequence_parallel else 1) + 4 * s_dec * b * ad / t
             + 4 * s_enc * b * ad / t)
    if not flash_attention:
        cross += 5 * b * model.num_heads / t * s_dec * s_enc
    return base + bias + cross


def t5_stage_activation_bytes(model: ModelConfig, stage: int, pp: int, s_enc: int, s_dec: int,
                              b: int, t: int = 1, sequence_parallel: bool = False,
                              flash_attention: bool = False) -> float:
    """One micro-batch's stored activations on pipeline stage `stage` (its layers from
    `t5_stage_layers`): its encoder and decoder layers; on a stage with decoder layers the
    encoder output they attend to, `2 s_e b h` (split with sequence parallelism); stage 0 the
    encoder's embedding, the first decoder stage the decoder's (`formulas.
    embedding_activation_bytes`), the last stage the logits (`formulas.logits_activation_bytes`
    over the decoder tokens)."""
    enc, dec = t5_stage_layers(stage, pp, model)
    h = model.hidden_size
    out = len(enc) * t5_encoder_layer_activation_bytes(model, s_enc, b, t, sequence_parallel,
                                                       flash_attention)
    if len(dec):
        out += len(dec) * t5_decoder_layer_activation_bytes(model, s_dec, s_enc, b, t,
                                                            sequence_parallel, flash_attention)
        out += 2 * s_enc * b * h / (t if sequence_parallel else 1)
    if stage == 0:
        out += F.embedding_activation_bytes(s_enc, b, h, t)
    if len(dec) and dec.start == 0:
        out += F.embedding_activation_bytes(s_dec, b, h, t)
    if stage == pp - 1:
        out += F.logits_activation_bytes(s_dec, b, h, model.vocab_size, t)
    return out
