"""The GPT decoder shared by the GPT-2, Llama and Nemotron families, tensor/sequence parallel.

One `GPTModel` is one pipeline stage: stage 0 holds the embeddings, the last stage the final
norm and the output projection, and each holds the layers `sharding.stage_layers` gives it,
named by their *global* index (`layers.7....`), so local parameter names equal the checkpoint's.
With the default (single stage, `ParallelGroups()`) it is the whole model in one process.

Activations inside are `(T, B, C)`; under sequence parallelism `(T / tp, B, C)` between the
tensor-parallel regions. Callers see `(B, T, ...)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core import fused
from tessera.core import linear_cross_entropy as chunked_ce
from tessera.core.attention_backends import cached_attention_backends
from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.kv_cache import KVCache
from tessera.core.models.decoder.mla import LatentAttention
from tessera.core.models.registry import family as model_family
from tessera.core.moe.layer import MoEFeedForward
from tessera.core.moe.shapes import is_moe_layer
from tessera.core.parallel import context_parallel as cpar
from tessera.core.parallel.context_parallel import SegmentedContext, SequenceContext
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)
from tessera.core.parallel.mappings import gather_from_tp, scatter_to_sequence
from tessera.core.parallel.random import recompute, tracker
from tessera.core.parallel.sharding import local_kv_heads, local_shape, stage_layers
from tessera.core.qk_norm import HeadNorm, ProjectionNorm
from tessera.core.rope_scaling import rotary_angles
from tessera.core.sliding_window import causal_window_mask, in_window
from tessera.core.softcap_attention import softcapped_attention
from tessera.core.stage import init_stage


class Norm(nn.Module):
    """LayerNorm, RMSNorm, Nemotron's LayerNorm1P or Gemma's RMSNorm1P (weight stored as an
    offset from 1; RMSNorm1P applies it in fp32, as Gemma does)."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.weight = nn.Parameter(torch.empty(config.hidden_size))
        rms = self.kind in ("rmsnorm", "rmsnorm1p")
        self.bias = None if rms else nn.Parameter(torch.empty(config.hidden_size))
        for p in self.parameters():
            # Under SP each tp rank sees a different sequence chunk: gradients must be summed.
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return fused.rms_norm(x, self.weight, self.eps)
        if self.kind == "rmsnorm1p":
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        weight = self.weight + 1 if self.kind == "layernorm1p" else self.weight
        return F.layer_norm(x, (x.shape[-1],), weight, self.bias, self.eps)


def make_norm(config: ModelConfig, sequence_parallel: bool) -> nn.Module:
    """One norm of a decoder stage: the family's own (`Family.norm`), else `Norm`."""
    return (model_family(config).norm or Norm)(config, sequence_parallel)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention) over the first `rotary_dim` dims,
    scaled as `config.rope_scaling` says (`core.rope_scaling`).

    The frequencies are computed in fp32 on every call (a few dozen numbers) rather than kept
    as a buffer, so casting the model to bf16 can never coarsen the angles, and the variants
    that depend on the sequence length see each call's.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin of shape `(B, 1, T, rotary_dim)` for integer `positions (B, T)`."""
        inv_freq, scale = rotary_angles(self.config, positions)  # (B, 1, rotary_dim / 2)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        if scale == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class Attention(nn.Module):
    """Causal self-attention with fused QKV, grouped-query heads, RoPE and an optional KV cache."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool,
                 selective_recompute: bool):
        super().__init__()
        tp = groups.tp_size
        self.layer, self.head_dim = layer, config.head_dim
        # tp > num_kv_heads: one kv head per rank, replicated (see sharding).
        self.n_heads, self.n_kv = config.num_heads // tp, local_kv_heads(config, tp)
        self.dropout, self.selective_recompute = config.dropout, selective_recompute
        # Gemma 2 (`Gemma2Options`): another score scale, soft-capped scores.
        scalar = getattr(config.options, "query_pre_attn_scalar", None)
        self.scale = None if scalar is None else float(scalar) ** -0.5
        self.softcap = getattr(config.options, "attn_logit_softcapping", None)
        self.window = config.layer_window(layer)  # None: the whole causal context
        qkv_rows = local_shape(f"layers.{layer}.attention.wqkv.weight", config, tp)[0]
        self.wqkv = ColumnParallelLinear(config.hidden_size, qkv_rows, config.qkv_bias,
                                         groups.tp_group, sp)
        self.wo = RowParallelLinear(self.n_heads * self.head_dim, config.hidden_size, config.bias,
                                    groups.tp_group, sp)
        # RMSNorm of q and k (core.qk_norm): per head (Qwen3) or over the projection (OLMo-2).
        self.qk_norm = config.qk_norm and config.qk_norm_width == "head"
        self.projection_norm = config.qk_norm and config.qk_norm_width == "projection"
        if self.qk_norm:
            self.q_norm, self.k_norm = HeadNorm(config, tp), HeadNorm(config, tp)
        elif self.projection_norm:
            self.q_norm = ProjectionNorm(config, config.num_heads, tp, groups.tp_group)
            self.k_norm = ProjectionNorm(config, config.num_kv_heads, tp, groups.tp_group)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, seq: SequenceContext | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        # Heads differ per tp rank: independent dropout masks. Without dropout there is nothing
        # to draw, and swapping the RNG state (a few KB, twice) cost 4% of a decode step.
        with tracker.fork() if p > 0 else contextlib.nullcontext():
            if seq is not None:  # context parallel and/or packed documents
                if self.scale is not None or self.softcap is not None:
                    raise NotImplementedError("context parallelism and packed documents use "
                                              "the default score scale without a soft cap")
                return cpar.attention(q, k, v, seq, p, window=self.window)
            if mask is None and self.window is not None:
                mask = causal_window_mask(q.shape[2], self.window, q.device)
            if self.softcap is not None:
                scale = self.scale if self.scale is not None else self.head_dim ** -0.5
                return softcapped_attention(q, k, v, mask, scale, self.softcap, p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  is_causal=mask is None, enable_gqa=True,
                                                  scale=self.scale)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...] | None,
                cache: KVCache | None, positions: torch.Tensor | None,
                slots: torch.Tensor | None, seq: SequenceContext | None = None) -> torch.Tensor:
        qkv = self.wqkv(x)  # (T, B, (nh + 2 nkv) hd) local heads; full T even under SP
        T, B = qkv.shape[:2]
        hd = self.head_dim
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        if self.projection_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(T, B, self.n_heads, hd).permute(1, 2, 0, 3)  # (B, nh, T, hd)
        k = k.reshape(T, B, self.n_kv, hd).permute(1, 2, 0, 3)
        v = v.reshape(T, B, self.n_kv, hd).permute(1, 2, 0, 3)
        if self.qk_norm:  # before RoPE, as Qwen3 does
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = fused.rotary(q, *rope), fused.rotary(k, *rope)
        mask = None
        if cache is not None and cache.attends:  # a paged kernel reading the blocks in place
            y = cache.attend(self.layer, q, k, v, positions, slots, self.window)
        else:
            if cache is not None:
                k, v, mask = cache.update(self.layer, k, v, positions, slots)
                if self.window is not None:  # cached keys sit at their positions 0..L-1
                    key_pos = torch.arange(k.shape[2], device=k.device)
                    mask = mask & in_window(positions, key_pos, self.window).unsqueeze(1)
            if self.selective_recompute and self.training and torch.is_grad_enabled():
                y = recompute(self._core, q, k, v, mask, seq)
            else:
                y = self._core(q, k, v, mask, seq)
        y = y.permute(2, 0, 1, 3).reshape(T, B, self.n_heads * hd)
        return self.wo(y)


class MLP(nn.Module):
    """Two linear layers around GELU, squared ReLU, or SwiGLU (fused gate/up in `w1`)."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool):
        super().__init__()
        self.activation = config.activation
        rows = local_shape(f"layers.{layer}.feed_forward.w1.weight", config, groups.tp_size)[0]
        self.w1 = ColumnParallelLinear(config.hidden_size, rows, config.bias, groups.tp_group, sp)
        self.w2 = RowParallelLinear(config.ffn_hidden_size // groups.tp_size, config.hidden_size,
                                    config.bias, groups.tp_group, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.activation == "swiglu":
            h = fused.swiglu(h)
        elif self.activation == "squared_relu":
            h = F.relu(h).square()
        elif self.activation == "geglu":  # Gemma: gelu (tanh form) of the gate, times up
            gate, up = h.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)
        return self.w2(h)


class Block(nn.Module):
    """Transformer layer: pre-norm `x + attn(norm(x))`, then `x + mlp(norm(x))`; with
    `config.norm_placement == "output"` (OLMo-2) `x + norm(attn(x))`, then `x + norm(mlp(x))`."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups,
                 sp: bool, selective_recompute: bool):
        super().__init__()
        self.attention_norm = make_norm(config, sp)
        attention = LatentAttention if config.mla is not None else Attention
        self.attention = attention(config, layer, groups, sp, selective_recompute)
        self.ffn_norm = make_norm(config, sp)
        self.feed_forward = (MoEFeedForward(config, layer, groups, sp)  # Mixture-of-Experts
                             if is_moe_layer(config, layer) else MLP(config, layer, groups, sp))
        self.dropout, self.sp = config.dropout, sp
        self.norm_output = config.norm_placement == "output"
        if config.norm_placement == "sandwich":  # Gemma 2: the sublayer outputs normed too
            self.post_attention_norm, self.post_ffn_norm = make_norm(config, sp), make_norm(config, sp)
        self.sandwich = config.norm_placement == "sandwich"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        if self.sp:  # sequence chunks differ per tp rank
            with tracker.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor, rope=None, cache=None, positions=None, slots=None,
                seq=None):
        if self.norm_output:
            x = x + self._drop(self.attention_norm(self.attention(x, rope, cache, positions,
                                                                  slots, seq)))
            return x + self._drop(self.ffn_norm(self.feed_forward(x)))
        if self.sandwich:
            x = x + self._drop(self.post_attention_norm(self.attention(
                self.attention_norm(x), rope, cache, positions, slots, seq)))
            return x + self._drop(self.post_ffn_norm(self.feed_forward(self.ffn_norm(x))))
        x = x + self._drop(self.attention(self.attention_norm(x), rope, cache, positions, slots,
                                          seq))
        return x + self._drop(self.feed_forward(self.ffn_norm(x)))


# A module called as hook(embeddings (B, T, C), input_ids (B, T), positions (B, T)) ->
# embeddings (B, T, C), on the first stage before any layer. Prompt tuning replaces the
# embeddings at positions [0, n_virtual) of the rows that use a task; per-batch context (which
# row uses which task) is set on the hook by its owner before the forward call.
EmbeddingHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GPTModel(nn.Module):
    """One pipeline stage (by default: all of it) of a GPT decoder.

    `forward(x)` takes token ids `(B, T)` on the first stage, otherwise the previous stage's
    hidden states; it returns hidden states on inner stages, and on the last stage:
    - `labels` given: the mean cross-entropy over labels != -100 (vocab-parallel, never gathered);
    - `local_logits=True`: this tp rank's logits `(B, T, V_padded / tp)` (pipeline schedules);
    - otherwise logits `(B, T, vocab_size)` gathered over tp, padding removed.

    Context parallelism (`layout.cp > 1`) and packed documents (`document_ids (B, T)`): every
    cp rank is given the WHOLE sequence (ids, labels, document ids, positions: all `(B, T)`)
    and keeps its own tokens (`context_parallel.zigzag_index`); hidden states between stages,
    logits and `local_logits` hold only those `T / cp` tokens, in that order. The loss is the
    mean over the whole sequence on every cp rank (`context_parallel.global_mean_loss`).
    Positions restart per document when document ids are given (and positions are not).
    Dynamic cp (`core.parallel.dynamic_cp_runtime`) lays the tokens out itself and passes
    `sequence`: then `x` and `labels` are this rank's tokens `(1, T_local)` and the loss is the
    mean over the whole cp group's tokens.
    """

    def __init__(self, config: ModelConfig, layout: Layout | None = None,
                 groups: ParallelGroups | None = None, stage_id: int = 0, num_stages: int = 1,
                 schedule: TrainSchedule | None = None):
        super().__init__()
        init_stage(self, config, layout, groups, stage_id, num_stages, schedule)
        g, sp, rc = self.groups, self.layout.sequence_parallel, self.train_schedule
        self.layer_ids = list(stage_layers(stage_id, num_stages, config.num_layers))
        if self.is_first:
            rows = local_shape("tok_embeddings.weight", config, g.tp_size)[0]
            self.tok_embeddings = VocabParallelEmbedding(rows, config.hidden_size, g.tp_rank,
                                                         g.tp_group)
            if config.position == "learned":
                self.pos_embeddings = nn.Embedding(config.max_position_embeddings,
                                                   config.hidden_size)
        self.rotary = Rotary(config) if config.position == "rope" else None
        selective = rc.recompute == "selective"
        self.layers = nn.ModuleDict({str(i): Block(config, i, g, sp, selective)
                                     for i in self.layer_ids})
        n_full = len(self.layer_ids) if rc.recompute_layers is None else rc.recompute_layers
        self.recompute_ids = set(self.layer_ids[:n_full]) if rc.recompute == "full" else set()
        if self.is_last:
            self.norm = make_norm(config, sp)
            rows = local_shape("tok_embeddings.weight", config, g.tp_size)[0]
            self.output = None
            if not (config.tied_embeddings and self.is_first):
                # A tied model on a separate last stage keeps its own copy of the embedding,
                # kept equal by summing gradients over `groups.embedding_group`.
                self.output = ColumnParallelLinear(config.hidden_size, rows, False, g.tp_group,
                                                   sp)
        self.embedding_hook: nn.Module | None = None  # set by prompt tuning
        self.final_softcap = getattr(config.options, "final_logit_softcapping", None)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's `cap * tanh(logits / cap)` of the output logits (as is without a cap)."""
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def global_name(self, local_name: str) -> str:
        """The checkpoint name of a local parameter (a tied output copy maps to the embedding)."""
        if local_name == "output.weight" and self.config.tied_embeddings:
            return "tok_embeddings.weight"
        return local_name

    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings `(B, T, C)`, then the embedding hook if set.

        `positions (B, T)` are absolute positions (default `0..T-1` for every row).
        """
        h = self.tok_embeddings(ids)
        if getattr(self.config.options, "scale_embeddings", False):  # Gemma: x sqrt(hidden)
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        if self.config.position == "learned":
            h = h + self.pos_embeddings(positions)
        if self.embedding_hook is not None:
            h = self.embedding_hook(h, ids, positions)
        return h

    def sequence(self, batch: int, seq_len: int, device: torch.device,
                 document_ids: torch.Tensor | None = None) -> SequenceContext | None:
        """This rank's `SequenceContext` of a `(batch, seq_len)` sequence, or None when the
        plain causal path serves (no cp, no documents)."""
        g = self.groups
        if g.cp_size == 1 and document_ids is None:
            return None
        return cpar.sequence_context(seq_len, batch, device, cp_size=g.cp_size,
                                     cp_rank=g.cp_rank, group=g.cp_group, ranks=g.cp_ranks,
                                     comm=self.train_schedule.cp_comm, documents=document_ids)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, local_logits: bool = False,
                document_ids: torch.Tensor | None = None,
                sequence: SegmentedContext | None = None,
                kv_length: int | None = None) -> torch.Tensor:
        sp = self.layout.sequence_parallel and cache is None
        seq, embedded = None, None
        if sequence is not None:  # dynamic cp: `x`, `labels` are this rank's tokens already
            seq, positions = sequence, sequence.positions(x.shape[0])
        elif self.groups.cp_size > 1 or document_ids is not None:
            if cache is not None:
                raise NotImplementedError("a KV cache (generation, serving) runs without "
                                          "context parallelism or packed documents")
            # The whole sequence's length: from the ids on the first stage, else from the
            # local hidden states (T / cp rows, / tp more under sequence parallelism).
            B, T = (x.shape[0], x.shape[1]) if self.is_first else (
                x.shape[1], x.shape[0] * (self.groups.tp_size if sp else 1) * self.groups.cp_size)
            seq = self.sequence(B, T, x.device, document_ids)
            if self.is_first and self.embedding_hook is not None and seq.cp_size > 1:
                # The hook (prompt tuning) reads each row's task at position 0, which only one
                # cp rank holds: it sees the whole rows, then this rank keeps its tokens.
                whole = seq.whole_positions(B) if positions is None else positions
                embedded = seq.split(self.embed(x, whole))
            positions = seq.positions(B) if positions is None else seq.split(positions)
            if self.is_first:
                x = seq.split(x)
        if self.is_first:
            h = (self.embed(x, positions) if embedded is None else embedded)
            h = h.transpose(0, 1).contiguous()  # (T, B, C)
            if sp:
                h = scatter_to_sequence(h, self.groups.tp_group)
            if self.training and self.config.dropout:
                with tracker.fork() if sp else contextlib.nullcontext():
                    h = F.dropout(h, self.config.dropout, True)
        else:
            h = x
        if cache is not None:
            if positions is None or slots is None:
                raise ValueError("a KV cache needs the positions and slots of the new tokens")
            cache.begin(positions, slots, length=kv_length)
        return self.forward_hidden(h, labels, positions=positions, cache=cache, slots=slots,
                                   local_logits=local_logits, seq=seq)

    def forward_hidden(self, h: torch.Tensor, labels: torch.Tensor | None = None, *,
                       positions: torch.Tensor | None = None, cache: KVCache | None = None,
                       slots: torch.Tensor | None = None, local_logits: bool = False,
                       seq: SequenceContext | None = None) -> torch.Tensor:
        """Everything after the embedding: `h (T, B, C)` (T / tp rows under sequence parallelism)
        through this stage's layers, and on the last stage the head, returning what `forward`
        returns. With a cache, `cache.begin(positions, slots)` must have planned this pass (as
        `forward` does). Reads no tensor values on the host, so it compiles as one graph
        (`serving.engine.compiled`). With `seq` (context parallel / packed documents, made by
        `forward`), `positions` are the local tokens' and `labels` the whole sequence's."""
        sp = self.layout.sequence_parallel and cache is None
        T = h.shape[0] * (self.groups.tp_size if sp else 1)
        B = h.shape[1]
        rope = None
        if self.rotary is not None:
            if positions is None:
                positions = torch.arange(T, device=h.device).expand(B, T)
            rope = self.rotary.cos_sin(positions, h.dtype)
        # Over a KV cache the key length is new every step: kernels chosen once for the pass.
        with cached_attention_backends() if cache is not None else contextlib.nullcontext():
            for i, layer in self.layers.items():
                if int(i) in self.recompute_ids and self.training and torch.is_grad_enabled():
                    h = recompute(layer, h, rope, None, None, None, seq)
                else:
                    h = layer(h, rope, cache, positions, slots, seq)
        if not self.is_last:
            return h
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if labels is not None:
            return self.head_loss(h, weight, labels, seq, sp)
        logits = column_parallel_linear(h, weight, None, self.groups.tp_group, sp)  # (T,B,V/tp)
        logits = self._softcap(logits).transpose(0, 1)
        if local_logits:
            return logits
        return gather_from_tp(logits, self.groups.tp_group)[..., : self.config.vocab_size]

    def head_loss(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             seq: SequenceContext | None, sp: bool) -> torch.Tensor:
        """The head's mean cross-entropy over `labels != -100` (see `forward`), from the final
        hidden states `h (T, B, C)` and the head `weight (V_padded / tp, C)`. On one tp rank
        with no vocabulary padding it may run chunked, without the whole logits
        (`core.linear_cross_entropy`); that is the same loss to float reassociation."""
        if seq is not None:
            labels = seq.split(labels)  # this cp rank's tokens: a selection, nothing else
        targets = labels.transpose(0, 1).reshape(-1)
        cp = seq is not None and seq.cp_size > 1
        if (self.groups.tp_group is None and weight.shape[0] == self.config.vocab_size
                and self.final_softcap is None and chunked_ce.wanted(h, weight.shape[0])):
            loss = chunked_ce.linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets,
                                                   reduction="sum" if cp else "mean")
            if not cp:
                return loss
            total = loss
        else:
            logits = self._softcap(column_parallel_linear(h, weight, None, self.groups.tp_group,
                                                          sp))
            total = vocab_parallel_cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets, self.groups.tp_group,
                self.groups.tp_rank, self.config.vocab_size).sum()
        if cp:
            return cpar.global_mean_loss(total, (labels != -100).sum(), seq.cp_size, seq.group)
        return total / (labels != -100).sum().clamp(min=1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference mean cross-entropy of full logits `(B, T, V)` against `labels (B, T)`."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100)


