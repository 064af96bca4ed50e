"""BERT (Devlin et al. 2018, https://arxiv.org/abs/1810.04805) on the decoder's parallel layers.

A bidirectional encoder: word + learned position + token-type embeddings, LayerNorm; layers of
`x = norm(x + attention(x))`, `x = norm(x + mlp(x))` (LayerNorm after the residual add, as in the
original), attention without a causal mask but with a padding mask; a masked-LM head (dense, GELU,
LayerNorm, then the decoder, which is the word embedding with a bias of its own); optionally a
[CLS] pooler and next-sentence classifier (`BertOptions.binary_head`).

The pieces are the decoder's: `Attention` (fused QKV, column/row parallel), `MLP`, `Norm`, the
vocabulary-parallel embedding and cross-entropy, so tensor and sequence parallelism work as for
GPT. One `BertModel` is one pipeline stage, with the interface `GPTModel` offers the pipeline,
checkpoint and optimizer code (`stage_id`, `is_first`, `is_last`, `global_name`, `output` as the
tied decoder copy on a separate last stage, kept equal by `pipeline.sync_tied_embedding_grads`).
Parameter names are in `core.models.bert.sharding`.

`forward(x, labels=None, *, token_types=None, attention_mask=None, next_sentence=None,
local_logits=False)`: `x` is token ids `(B, T)` on the first stage, else the previous stage's
hidden states `(T, B, C)`; `token_types (B, T)` (default all 0) and `attention_mask (B, T)`
(1 = token, 0 = padding; default all tokens) go to every stage. The last stage returns:
- `labels (B, T)` given: the mean masked-LM cross-entropy over labels != -100, plus the mean
  next-sentence cross-entropy when `next_sentence (B,)` is given (binary head only);
- `local_logits=True`: this tp rank's masked-LM logits `(B, T, V_padded / tp)`;
- otherwise the masked-LM logits `(B, T, vocab_size)`, gathered over tp.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.models.decoder.model import MLP, Attention, Norm
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)
from tessera.core.parallel.mappings import gather_from_tp, scatter_to_sequence
from tessera.core.parallel.random import recompute, tracker
from tessera.core.parallel.sharding import local_shape, stage_layers
from tessera.core.stage import init_stage


class BertAttention(Attention):
    """Self-attention over every unmasked key (no causal mask, no KV cache, no RoPE)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        qkv = self.wqkv(x)  # (T, B, 3 nh hd) local heads; full T even under SP
        T, B = qkv.shape[:2]
        hd = self.head_dim
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        q = q.reshape(T, B, self.n_heads, hd).permute(1, 2, 0, 3)  # (B, nh, T, hd)
        k = k.reshape(T, B, self.n_kv, hd).permute(1, 2, 0, 3)
        v = v.reshape(T, B, self.n_kv, hd).permute(1, 2, 0, 3)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self._core, q, k, v, mask)
        else:
            y = self._core(q, k, v, mask)
        return self.wo(y.permute(2, 0, 1, 3).reshape(T, B, self.n_heads * hd))


class BertBlock(nn.Module):
    """Post-norm encoder layer: `x = norm(x + attn(x))`, then `x = norm(x + mlp(x))`."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool,
                 selective_recompute: bool):
        super().__init__()
        self.attention = BertAttention(config, layer, groups, sp, selective_recompute)
        self.attention_norm = Norm(config, sp)
        self.feed_forward = MLP(config, layer, groups, sp)
        self.ffn_norm = Norm(config, sp)
        self.dropout, self.sp = config.dropout, sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        with tracker.fork() if self.sp else contextlib.nullcontext():  # chunks differ per rank
            return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self._drop(self.attention(x, mask)))
        return self.ffn_norm(x + self._drop(self.feed_forward(x)))


class _Dense(nn.Module):
    """A replicated `y = x W^T + b`; under sequence parallelism its input is this rank's chunk of
    the sequence, so its gradients are partial and marked for the tp sum."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MaskedLMHead(nn.Module):
    """dense -> GELU -> LayerNorm; the decoder (the tied embedding) and its bias are applied
    by `BertModel`, column-parallel over the vocabulary."""

    def __init__(self, config: ModelConfig, tp_size: int, sp: bool):
        super().__init__()
        self.dense = _Dense(config.hidden_size, config.hidden_size, sp)
        self.layer_norm = Norm(config, sp)
        self.bias = nn.Parameter(torch.empty(local_shape("lm_head.bias", config, tp_size)))
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(h), approximate=self.approximate))


class BertModel(nn.Module):
    """One pipeline stage (by default: all of it) of a BERT encoder; see the module docstring."""

    def __init__(self, config: ModelConfig, layout: Layout | None = None,
                 groups: ParallelGroups | None = None, stage_id: int = 0, num_stages: int = 1,
                 schedule: TrainSchedule | None = None):
        super().__init__()
        init_stage(self, config, layout, groups, stage_id, num_stages, schedule)
        g, sp, rc = self.groups, self.layout.sequence_parallel, self.train_schedule
        self.layer_ids = list(stage_layers(stage_id, num_stages, config.num_layers))
        vocab_rows = local_shape("tok_embeddings.weight", config, g.tp_size)[0]
        c = config.hidden_size
        if self.is_first:
            self.tok_embeddings = VocabParallelEmbedding(vocab_rows, c, g.tp_rank, g.tp_group)
            self.pos_embeddings = nn.Embedding(config.max_position_embeddings, c)
            self.type_embeddings = nn.Embedding(config.options.type_vocab_size, c)
            self.embed_norm = Norm(config, False)  # runs on the whole sequence, before SP
        selective = rc.recompute == "selective"
        self.layers = nn.ModuleDict({str(i): BertBlock(config, i, g, sp, selective)
                                     for i in self.layer_ids})
        n_full = len(self.layer_ids) if rc.recompute_layers is None else rc.recompute_layers
        self.recompute_ids = set(self.layer_ids[:n_full]) if rc.recompute == "full" else set()
        if self.is_last:
            if config.options.binary_head:  # on the gathered [CLS] row: replicated, full gradients
                self.pooler = nn.Module()
                self.pooler.dense = _Dense(c, c, False)
                self.binary_head = _Dense(c, 2, False)
            self.lm_head = MaskedLMHead(config, g.tp_size, sp)
            # A last stage without the embedding keeps a copy of it as the decoder.
            self.output = None if self.is_first else ColumnParallelLinear(
                c, vocab_rows, False, g.tp_group, sp)
        self.embedding_hook: nn.Module | None = None  # prompt tuning is refused for BERT

    def global_name(self, local_name: str) -> str:
        """The checkpoint name of a local parameter (the decoder copy maps to the embedding)."""
        return "tok_embeddings.weight" if local_name == "output.weight" else local_name

    def embed(self, ids: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        """LayerNorm(word + position + token-type embeddings) `(B, T, C)`."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        if token_types is None:
            token_types = torch.zeros_like(ids)
        h = self.tok_embeddings(ids) + self.pos_embeddings(positions) + self.type_embeddings(
            token_types)
        return self.embed_norm(h)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                token_types: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                next_sentence: torch.Tensor | None = None,
                local_logits: bool = False) -> torch.Tensor:
        g, sp = self.groups, self.layout.sequence_parallel
        if self.is_first:
            h = self.embed(x, token_types).transpose(0, 1).contiguous()  # (T, B, C)
            if sp:
                h = scatter_to_sequence(h, g.tp_group)
            if self.training and self.config.dropout:
                with tracker.fork() if sp else contextlib.nullcontext():
                    h = F.dropout(h, self.config.dropout, True)
        else:
            h = x
        B = h.shape[1]
        T = h.shape[0] * (g.tp_size if sp else 1)
        keep = (torch.ones(B, T, dtype=torch.bool, device=h.device) if attention_mask is None
                else attention_mask.bool())
        mask = keep[:, None, None, :]  # (B, 1, 1, T): every query sees every unpadded key
        for i, layer in self.layers.items():
            if int(i) in self.recompute_ids and self.training and torch.is_grad_enabled():
                h = recompute(layer, h, mask)
            else:
                h = layer(h, mask)
        if not self.is_last:
            return h
        return self._head(h, labels, next_sentence, local_logits)

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None,
              next_sentence: torch.Tensor | None, local_logits: bool) -> torch.Tensor:
        g, sp = self.groups, self.layout.sequence_parallel
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        logits = column_parallel_linear(self.lm_head(h), weight, self.lm_head.bias, g.tp_group,
                                        sp)  # (T, B, V_padded / tp)
        if labels is None:
            logits = logits.transpose(0, 1)
            return logits if local_logits else gather_from_tp(
                logits, g.tp_group)[..., : self.config.vocab_size]
        losses = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.transpose(0, 1).reshape(-1),
            g.tp_group, g.tp_rank, self.config.vocab_size)
        loss = losses.sum() / (labels != -100).sum().clamp(min=1)
        if next_sentence is not None:
            loss = loss + F.cross_entropy(self.next_sentence_logits(h).float(), next_sentence)
        return loss

    def next_sentence_logits(self, h: torch.Tensor) -> torch.Tensor:
        """`(B, 2)` is-random-next logits from the last layer's `h (T, B, C)` [CLS] row."""
        if not self.config.options.binary_head:
            raise ValueError("this BERT has no next-sentence head: set binary_head=True")
        if self.layout.sequence_parallel:
            # [CLS] sits in tp rank 0's chunk. Gather along the last dim, whose backward
            # splits: the replicated pooler gives every rank the same full gradient, which
            # `gather_from_sequence`'s reduce-scatter would count tp times.
            cls = gather_from_tp(h.permute(1, 2, 0).contiguous(), self.groups.tp_group)[..., 0]
        else:
            cls = h[0]  # (B, C)
        pooled = torch.tanh(self.pooler.dense(cls))
        return self.binary_head(pooled)
