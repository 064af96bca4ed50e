"""T5: an encoder-decoder on the tensor/sequence/pipeline-parallel layers of the GPT model.

What T5 computes (Raffel et al. 2020; v1.1 as Hugging Face's `T5ForConditionalGeneration`):
pre-norm blocks with RMSNorm (no bias, no mean), attention WITHOUT the 1/sqrt(d) scaling, whose
scores take a learned bias per head and relative-position bucket (bidirectional buckets in the
encoder, causal ones in the decoder), computed by layer 0 of each stack and shared by its later
layers; decoder blocks add cross-attention over the encoder output; the MLP is gated GELU (v1.1,
`activation="geglu"`) or ReLU (the original). One embedding table feeds both stacks; the
output projection is separate (v1.1) or the embedding, with the decoder output scaled by
hidden_size ** -0.5 first (`options.scaled_output`, the original).

One `T5Model` is one pipeline stage (see `core.models.t5.sharding` for the names and tp
splits, `core.models.t5.layout` for how stages share out encoder and decoder). Call it as

    model(encoder_ids (B, S), decoder_input_ids=(B, T), labels=(B, T) | None,
          encoder_mask=(B, S) | None, local_logits=False)

on a single stage: with labels the mean cross-entropy over labels != -100 (vocab-parallel,
never gathered), else logits `(B, T, vocab_size)` (or this tp rank's padded shard with
`local_logits`). `encoder_mask` is 1 for real tokens, 0 for padding. Between pipeline stages
the positional inputs / outputs are, `(T, B, C)` hidden states (`T / tp` rows under sequence
parallelism) and `(1, H / tp, T, T)` position biases:

    encoder stage       in: ids (stage 0) or (h_enc, bias_enc)   out: (h_enc, bias_enc)
    last encoder stage                                          out: enc_out (normed)
    first decoder stage in: enc_out                             out: (h_dec, bias_dec, enc_out)
    later decoder stage in: (h_dec, bias_dec, enc_out)          out: the same, or the head's

so the encoder output reaches every decoder stage by being passed along (its gradient comes back
summed over the stages that attend to it), and the keywords (`decoder_input_ids`,
`encoder_mask`) are given to every stage, as `torch.distributed.pipelining` hands keyword
arguments to each stage's micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.models.decoder.model import Norm
from tessera.core.models.t5.layout import t5_model_problems, t5_stage_layers, t5_stage_split
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)
from tessera.core.parallel.mappings import gather_from_tp, scatter_to_sequence
from tessera.core.parallel.random import tracker
from tessera.core.parallel.sharding import local_shape
from tessera.core.stage import init_stage


def relative_position_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> torch.Tensor:
    """The bucket of each `relative = key position - query position`.

    Bidirectional: half the buckets for keys after the query. Within a half, distances below a
    quarter of the buckets get one bucket each, larger ones share log-spaced buckets up to
    `max_distance`, beyond which all share the last. Causal: only keys at or before the query
    count (later ones fall in bucket 0; the causal mask hides them anyway).
    """
    if bidirectional:
        num_buckets //= 2
        offset = (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        offset = torch.zeros_like(relative)
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    # log(0) is -inf where distance is 0: those entries take the exact branch below.
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return offset + torch.where(distance < exact, distance, far)


class RelativeBias(nn.Module):
    """`weight (buckets, H / tp)`: this tp rank's heads' bias per relative-position bucket."""

    def __init__(self, config: ModelConfig, heads_local: int, bidirectional: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.options.relative_attention_num_buckets, heads_local))
        self.bidirectional = bidirectional
        self.max_distance = config.options.relative_attention_max_distance

    def forward(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:
        """The bias `(1, H / tp, q_len, k_len)` of queries at `offset + [0, q_len)`."""
        device = self.weight.device
        q = torch.arange(q_len, device=device).unsqueeze(1) + offset
        k = torch.arange(k_len, device=device).unsqueeze(0)
        buckets = relative_position_buckets(k - q, self.bidirectional, self.weight.shape[0],
                                            self.max_distance)
        # Contiguous: it may be sent to the next pipeline stage, whose receive buffer is.
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0).contiguous()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
            dropout: float) -> torch.Tensor:
    """Unscaled softmax attention with an additive bias: `(B, h, T, d)` -> `(T, B, h d)`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias
    probs = torch.softmax(scores.float(), dim=-1).type_as(scores)
    if dropout:
        with tracker.fork():  # heads differ per tp rank: independent masks
            probs = F.dropout(probs, dropout, True)
    y = torch.matmul(probs, v)  # (B, h, T, d)
    return y.permute(2, 0, 1, 3).reshape(y.shape[2], y.shape[0], -1)


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """`(T, B, n d)` -> `(B, n, T, d)`."""
    T, B = x.shape[:2]
    return x.reshape(T, B, n, -1).permute(1, 2, 0, 3)


@dataclass
class T5Cache:
    """Per decoder layer: self-attention keys/values so far, and the cross-attention keys/values
    of the encoder output (computed on the first step). `length` tokens decoded so far."""

    self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    length: int = 0


class SelfAttention(nn.Module):
    """Self-attention over fused `[q; k; v]` (this rank's heads); layer 0 holds the bias."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool,
                 causal: bool):
        super().__init__()
        self.n_heads = config.num_heads // groups.tp_size
        self.dropout, self.layer = config.dropout, layer
        hd = self.n_heads * config.head_dim
        self.wqkv = ColumnParallelLinear(config.hidden_size, 3 * hd, False, groups.tp_group, sp)
        self.wo = RowParallelLinear(hd, config.hidden_size, False, groups.tp_group, sp)
        if layer == 0:  # held by the first layer, shared by the stack (as Hugging Face does)
            self.relative_attention_bias = RelativeBias(config, self.n_heads, not causal)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cache: T5Cache | None
                ) -> torch.Tensor:
        q, k, v = (_heads(t, self.n_heads) for t in self.wqkv(x).chunk(3, dim=-1))
        if cache is not None:
            if self.layer in cache.self_kv:
                past_k, past_v = cache.self_kv[self.layer]
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            cache.self_kv[self.layer] = (k, v)
        p = self.dropout if self.training else 0.0
        return self.wo(_attend(q, k, v, bias, p))


class CrossAttention(nn.Module):
    """Decoder queries over the encoder output's keys and values (`wkv = [k; v]`)."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool):
        super().__init__()
        self.n_heads = config.num_heads // groups.tp_size
        self.dropout, self.layer = config.dropout, layer
        hd = self.n_heads * config.head_dim
        self.wq = ColumnParallelLinear(config.hidden_size, hd, False, groups.tp_group, sp)
        self.wkv = ColumnParallelLinear(config.hidden_size, 2 * hd, False, groups.tp_group, sp)
        self.wo = RowParallelLinear(hd, config.hidden_size, False, groups.tp_group, sp)

    def forward(self, x: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor,
                cache: T5Cache | None) -> torch.Tensor:
        q = _heads(self.wq(x), self.n_heads)
        if cache is not None and self.layer in cache.cross_kv:
            k, v = cache.cross_kv[self.layer]
        else:
            k, v = (_heads(t, self.n_heads) for t in self.wkv(enc).chunk(2, dim=-1))
            if cache is not None:
                cache.cross_kv[self.layer] = (k, v)
        p = self.dropout if self.training else 0.0
        return self.wo(_attend(q, k, v, mask, p))


class MLP(nn.Module):
    """`w2(act(w1 x))`; gated GELU (`geglu`: `gelu_tanh(gate) * up`, `w1 = [gate; up]`) or ReLU."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, sp: bool):
        super().__init__()
        self.activation, f = config.activation, config.ffn_hidden_size // groups.tp_size
        self.w1 = ColumnParallelLinear(config.hidden_size, f * (2 if config.gated else 1), False,
                                       groups.tp_group, sp)
        self.w2 = RowParallelLinear(f, config.hidden_size, False, groups.tp_group, sp)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.activation == "geglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif self.activation == "relu":
            h = F.relu(h)
        else:
            raise ValueError(f"T5 takes activation 'geglu' or 'relu', not {self.activation!r}")
        if self.training and self.dropout:
            with tracker.fork():  # ffn columns differ per tp rank
                h = F.dropout(h, self.dropout, True)
        return self.w2(h)


class Block(nn.Module):
    """`x + attn(norm x)`, in the decoder `+ cross(norm x, encoder output)`, `+ mlp(norm x)`."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool,
                 decoder: bool):
        super().__init__()
        self.attention_norm = Norm(config, sp)
        self.attention = SelfAttention(config, layer, groups, sp, causal=decoder)
        if decoder:
            self.cross_attention_norm = Norm(config, sp)
            self.cross_attention = CrossAttention(config, layer, groups, sp)
        self.ffn_norm = Norm(config, sp)
        self.feed_forward = MLP(config, groups, sp)
        self.dropout, self.sp = config.dropout, sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        with tracker.fork() if self.sp else contextlib.nullcontext():  # sequence chunks differ
            return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, enc: torch.Tensor | None = None,
                cross_mask: torch.Tensor | None = None, cache: T5Cache | None = None
                ) -> torch.Tensor:
        x = x + self._drop(self.attention(self.attention_norm(x), bias, cache))
        if enc is not None:
            x = x + self._drop(self.cross_attention(self.cross_attention_norm(x), enc,
                                                    cross_mask, cache))
        return x + self._drop(self.feed_forward(self.ffn_norm(x)))


class Stack(nn.Module):
    """A stage's layers of one stack (named by global index) and, on its last stage, the norm."""

    def __init__(self, config: ModelConfig, layer_ids: range, groups: ParallelGroups, sp: bool,
                 decoder: bool, with_norm: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(config, i, groups, sp, decoder)
                                     for i in layer_ids})
        self.norm = Norm(config, sp) if with_norm else None


def padding_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive key mask `(B, 1, 1, S)` from `mask (B, S)` (1 = attend), or a scalar 0."""
    if mask is None:
        return torch.zeros((), dtype=dtype)
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def causal_bias(q_len: int, k_len: int, offset: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive causal mask `(q_len, k_len)` for queries at positions `offset + [0, q_len)`."""
    q = torch.arange(q_len, device=device).unsqueeze(1) + offset
    k = torch.arange(k_len, device=device).unsqueeze(0)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(k > q, torch.finfo(dtype).min)


class T5Model(nn.Module):
    """One pipeline stage (by default: all) of a T5 encoder-decoder; see the module docstring.

    `encoder_stages`: how many of the `num_stages` stages hold the encoder (default: see
    `t5_layout.t5_stage_split`).
    """

    def __init__(self, config: ModelConfig, layout: Layout | None = None,
                 groups: ParallelGroups | None = None, stage_id: int = 0, num_stages: int = 1,
                 schedule: TrainSchedule | None = None, encoder_stages: int | None = None):
        super().__init__()
        if config.family != "t5":
            raise ConfigError(f"T5Model builds family 't5', not {config.family!r}")
        problems = t5_model_problems(config)
        if problems:
            raise ConfigError("not a T5 configuration:\n  - " + "\n  - ".join(problems))
        init_stage(self, config, layout, groups, stage_id, num_stages, schedule)
        if self.train_schedule.recompute != "none":
            raise NotImplementedError("T5 runs without activation recomputation (recompute "
                                      f"{self.train_schedule.recompute!r}); use 'none'")
        g, sp = self.groups, self.layout.sequence_parallel
        self.split = t5_stage_split(config, num_stages, encoder_stages)
        enc_ids, dec_ids = t5_stage_layers(stage_id, num_stages, config, self.split)
        self.has_encoder, self.has_decoder = len(enc_ids) > 0, len(dec_ids) > 0
        self.last_encoder = self.has_encoder and stage_id == (0 if num_stages == 1
                                                              else self.split - 1)
        self.first_decoder = self.has_decoder and (num_stages == 1 or stage_id == self.split)
        self.tok_embeddings = self.embedding_copy = None
        rows = local_shape("tok_embeddings.weight", config, g.tp_size)[0]
        if self.is_first:
            self.tok_embeddings = VocabParallelEmbedding(rows, config.hidden_size, g.tp_rank,
                                                         g.tp_group)
        elif self.first_decoder or (self.is_last and config.tied_embeddings):
            # A copy of the embedding on a later stage (the decoder's input, a tied output):
            # never saved (`global_name`), kept equal to stage 0's by summing their gradients
            # (`t5_pipeline.sync_t5_embedding_grads`).
            self.embedding_copy = VocabParallelEmbedding(rows, config.hidden_size, g.tp_rank,
                                                         g.tp_group)
        self.encoder = Stack(config, enc_ids, g, sp, False, self.last_encoder)
        self.decoder = Stack(config, dec_ids, g, sp, True, self.is_last)
        self.output = None
        if self.is_last and not config.tied_embeddings:
            rows = local_shape("output.weight", config, g.tp_size)[0]
            self.output = ColumnParallelLinear(config.hidden_size, rows, False, g.tp_group, sp)

    def global_name(self, local_name: str) -> str:
        """The checkpoint name of a local parameter (an embedding copy maps to the embedding)."""
        return "tok_embeddings.weight" if local_name == "embedding_copy.weight" else local_name

    @property
    def embedding(self) -> VocabParallelEmbedding:
        """This stage's embedding table: stage 0's own or its copy."""
        return self.tok_embeddings if self.tok_embeddings is not None else self.embedding_copy

    # ------------------------------------------------------------------------------ pieces

    def _drop(self, h: torch.Tensor, sp: bool) -> torch.Tensor:
        if not self.training or not self.config.dropout:
            return h
        with tracker.fork() if sp else contextlib.nullcontext():
            return F.dropout(h, self.config.dropout, True)

    def embed(self, ids: torch.Tensor, sp: bool) -> torch.Tensor:
        """Token embeddings of `ids (B, T)` as `(T, B, C)` (`T / tp` rows under SP)."""
        h = self.embedding(ids).transpose(0, 1).contiguous()
        if sp:
            h = scatter_to_sequence(h, self.groups.tp_group)
        return self._drop(h, sp)

    def _full_len(self, h: torch.Tensor, sp: bool) -> int:
        return h.shape[0] * (self.groups.tp_size if sp else 1)

    def run_encoder(self, h: torch.Tensor, bias: torch.Tensor | None,
                    encoder_mask: torch.Tensor | None, sp: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's encoder layers over `h`; the final norm on the last encoder stage
        (then the bias is None). `bias` is None on the stage holding layer 0."""
        mask = padding_bias(encoder_mask, h.dtype).to(h.device)
        for i, layer in self.encoder.layers.items():
            if i == "0":
                S = self._full_len(h, sp)
                bias = layer.attention.relative_attention_bias(S, S).to(h.dtype)
            h = layer(h, bias + mask)
        if self.encoder.norm is None:
            return h, bias
        return self._drop(self.encoder.norm(h), sp), None

    def run_decoder(self, h: torch.Tensor, bias: torch.Tensor | None, enc: torch.Tensor,
                    encoder_mask: torch.Tensor | None, sp: bool, cache: T5Cache | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's decoder layers over `h` attending to `enc`; `bias` as `run_encoder`'s.
        With `cache`, `h` holds the new tokens at positions `cache.length + [0, T)`."""
        offset = 0 if cache is None else cache.length
        T = self._full_len(h, sp)
        cross = padding_bias(encoder_mask, h.dtype).to(h.device)
        causal = causal_bias(T, offset + T, offset, h.dtype, h.device)
        for i, layer in self.decoder.layers.items():
            if i == "0":
                bias = layer.attention.relative_attention_bias(T, offset + T, offset).to(h.dtype)
            h = layer(h, bias + causal, enc, cross, cache)
        if cache is not None:
            cache.length += T
        return h, bias

    def head(self, h: torch.Tensor, labels: torch.Tensor | None, local_logits: bool,
             sp: bool) -> torch.Tensor:
        """Decoder norm and output projection: the loss, or logits (see the module docstring)."""
        h = self._drop(self.decoder.norm(h), sp)
        if self.config.options.scaled_output:
            h = h * self.config.hidden_size ** -0.5
        weight = self.embedding.weight if self.output is None else self.output.weight
        logits = column_parallel_linear(h, weight, None, self.groups.tp_group, sp)  # (T,B,V/tp)
        if labels is not None:
            losses = vocab_parallel_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.transpose(0, 1).reshape(-1),
                self.groups.tp_group, self.groups.tp_rank, self.config.vocab_size)
            return losses.sum() / (labels != -100).sum().clamp(min=1)
        logits = logits.transpose(0, 1)
        if local_logits:
            return logits
        return gather_from_tp(logits, self.groups.tp_group)[..., : self.config.vocab_size]

    # ------------------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, *carried: torch.Tensor,
                decoder_input_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, encoder_mask: torch.Tensor | None = None,
                local_logits: bool = False):
        sp = self.layout.sequence_parallel
        if self.has_encoder:
            if self.is_first:
                h, bias = self.embed(x, sp), None
            else:
                h, bias = x, carried[0]
            h, bias = self.run_encoder(h, bias, encoder_mask, sp)
            if not self.last_encoder:
                return h, _passed(bias)
            enc = h
            if not self.has_decoder:
                return enc
            dec, dec_bias = None, None
        elif self.first_decoder:
            enc, dec, dec_bias = x, None, None
        else:
            dec, dec_bias, enc = x, carried[0], carried[1]
        if self.first_decoder:
            if decoder_input_ids is None:
                raise ValueError("the first decoder stage needs decoder_input_ids (B, T)")
            dec = self.embed(decoder_input_ids, sp)
        dec, dec_bias = self.run_decoder(dec, dec_bias, enc, encoder_mask, sp)
        if not self.is_last:
            return dec, _passed(dec_bias), _passed(enc)
        return self.head(dec, labels, local_logits, sp)

    # ------------------------------------------------------------------------- generation

    def encode(self, encoder_ids: torch.Tensor, encoder_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The encoder output `(S, B, C)` of `encoder_ids (B, S)` (single stage, no SP)."""
        self._check_single("encode")
        return self.run_encoder(self.embed(encoder_ids, False), None, encoder_mask, False)[0]

    def decode(self, decoder_ids: torch.Tensor, enc: torch.Tensor,
               encoder_mask: torch.Tensor | None, cache: T5Cache) -> torch.Tensor:
        """Logits `(B, T, vocab_size)` of the new decoder tokens `decoder_ids (B, T)` after the
        `cache.length` tokens the cache holds; the cache takes their keys and values."""
        self._check_single("decode")
        h, _ = self.run_decoder(self.embed(decoder_ids, False), None, enc, encoder_mask, False,
                                cache)
        return self.head(h, None, False, False)

    def _check_single(self, what: str) -> None:
        if self.num_stages != 1:
            raise NotImplementedError(f"T5 {what} runs on a single pipeline stage (pp 1)")


def _passed(t: torch.Tensor) -> torch.Tensor:
    """A received tensor sent on to the next stage: a view, so its gradient from the next stage
    flows back into the received one (and on to the stage that made it)."""
    return t.view_as(t)
