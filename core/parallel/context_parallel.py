"""Context parallelism: each sequence split over the cp group, with exact causal attention.

The split is load-balanced for causal attention: a sequence of T tokens is cut into 2 * cp equal
chunks and cp rank r holds chunks r and 2cp - 1 - r (`zigzag_index`), so every rank holds as many
early (cheap) as late (expensive) queries, as Megatron-Core does. Everything outside attention
is per token, so it runs on the local tokens unchanged; only attention needs the other ranks'
keys and values. Two ways to get them, chosen by `TrainSchedule.cp_comm`:

- `allgather`: all-gather K and V over the cp group with the functional collective whose
  backward is a reduce-scatter (it runs on gloo), then one masked SDPA of the local queries
  against every key. Simple, works with attention dropout; holds the whole K/V per layer.
- `ring`: K/V blocks travel around the ring by point-to-point sends; while one block's
  attention is computed the next block is already in flight. Partial results are merged with
  their log-sum-exp (`merge_partials`), so no rank ever holds more than two blocks. Its
  backward (`_RingAttention`) sends the blocks around again, with their key/value gradient
  accumulators travelling behind them, and each block's gradient arrives back at its owner
  after a full turn. Attention dropout is applied inside the ring with a mask that is a hash
  of (seed, row, head, global query, global key) (`dropout_scale`): deterministic for a seed,
  the same whichever rank computes a pair, with dropout's statistics, but not SDPA's draws.

The mask compares GLOBAL token indices (query index >= key index), and, for packed documents,
document ids (`document_ids`, one per token, equal within a document): no token attends across a
document boundary. A sliding window (`core.sliding_window`) compares global indices too: within a
document they differ as its positions do. Positions (RoPE and learned) are the global ones,
restarted per document when documents are packed (`document_positions`), so a cp rank's tokens
are embedded as they would be in one process. Everything here also runs with cp 1 (packed
documents without cp).

`zigzag_index` and `SequenceContext` take the cp size and rank as plain numbers, so dynamic cp
(`dynamic_cp_runtime`) builds a context per sequence over a sub-group. The ring skips what lies
above the causal diagonal (`visible_block`): after its own block, each step computes half a
block (the allgather path masks those pairs in one SDPA call instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.core.sliding_window import in_window

# ------------------------------------------------------------------------------- the split


def zigzag_index(seq_len: int, cp: int, cp_rank: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The global token indices cp rank `cp_rank` of `cp` holds, in local order: chunk
    `cp_rank`, then chunk `2cp - 1 - cp_rank`, of `2 * cp` equal chunks. Raises ValueError when
    `seq_len` is not a multiple of `2 * cp` (say which numbers and what to do)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}; "
                         f"use a multiple of {2 * cp} or a smaller cp")
    size = seq_len // (2 * cp)
    first, second = cp_rank * size, (2 * cp - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size, device=device),
                      torch.arange(second, second + size, device=device)])


def split_sequence(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's tokens of `x` along `dim` (`zigzag_index` order)."""
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_index(x.shape[dim], cp, cp_rank, x.device))


def unsplit_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's part (by cp rank), inverse of `split_sequence`."""
    cp = len(parts)
    local = parts[0].shape[dim]
    seq_len = local * cp
    order = torch.cat([zigzag_index(seq_len, cp, r, parts[0].device) for r in range(cp)])
    out = torch.empty_like(torch.cat(parts, dim))
    return out.index_copy_(dim, order, torch.cat(parts, dim))


def gather_sequence(x: torch.Tensor, dim: int, cp: int,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence on every cp rank from each rank's part `x` (`split_sequence` order)
    along `dim`; no gradient (evaluation, generation)."""
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unsplit_sequence(parts, dim)


# ------------------------------------------------------------------------- packed documents


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Per-token document ids `(B, T)` of a packed stream: a new document starts after every
    end-of-document token (the EOD belongs to the document it ends), as Megatron's
    `reset_attention_mask` reads them."""
    is_eod = (tokens == eod_id).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions `(B, T)` that restart at 0 where the document id changes (Megatron's
    `reset_position_ids`)."""
    T = doc_ids.shape[-1]
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


# ---------------------------------------------------------------------------- the context


@dataclass(frozen=True)
class SequenceContext:
    """Where this rank's tokens sit in the global sequence, and how attention reaches the rest.

    `index (T_local,)`: global token indices held here (`zigzag_index`); `documents (B, T)`:
    global per-token document ids, or None (one document per row); `group` / `ranks`: the cp
    group and its members' global ranks by cp rank (None / (rank,) when cp is 1).
    """

    seq_len: int
    index: torch.Tensor
    cp_size: int = 1
    cp_rank: int = 0
    group: dist.ProcessGroup | None = None
    ranks: tuple[int, ...] = (0,)
    comm: str = "allgather"
    documents: torch.Tensor | None = None

    def rank_index(self, cp_rank: int) -> torch.Tensor:
        """The global indices held by cp rank `cp_rank`."""
        if cp_rank == self.cp_rank:
            return self.index
        return zigzag_index(self.seq_len, self.cp_size, cp_rank, self.index.device)

    def positions(self, batch: int) -> torch.Tensor:
        """The local tokens' positions `(B, T_local)`: global ones, restarted per document."""
        if self.documents is None:
            return self.index.expand(batch, -1)
        return document_positions(self.documents)[:, self.index]

    def whole_positions(self, batch: int) -> torch.Tensor:
        """Every token's position `(B, T)` (global index, restarted per document)."""
        if self.documents is None:
            return torch.arange(self.seq_len, device=self.index.device).expand(batch, -1)
        return document_positions(self.documents)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The local tokens of a whole-sequence tensor (ids, labels: dim 1)."""
        if self.cp_size == 1:
            return x
        return x.index_select(dim, self.index)

    def mask(self, key_index: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Which keys each local query may see: `(B or 1, T_local, T_keys)` booleans;
        `window`: only the last `window` keys up to each query's own (sliding window)."""
        allowed = self.index[:, None] >= key_index[None, :]
        if window is not None:
            allowed = allowed & in_window(self.index, key_index, window)
        allowed = allowed.unsqueeze(0)
        if self.documents is not None:
            docs = self.documents
            allowed = allowed & (docs[:, self.index, None] == docs[:, None, key_index])
        return allowed


def sequence_context(seq_len: int, batch: int, device: torch.device, *, cp_size: int = 1,
                     cp_rank: int = 0, group: dist.ProcessGroup | None = None,
                     ranks: tuple[int, ...] = (0,), comm: str = "allgather",
                     documents: torch.Tensor | None = None) -> SequenceContext:
    """The `SequenceContext` of a `(batch, seq_len)` sequence on cp rank `cp_rank`."""
    if documents is not None and tuple(documents.shape) != (batch, seq_len):
        raise ValueError(f"document ids have shape {tuple(documents.shape)}, the batch is "
                         f"{(batch, seq_len)}; give one id per token")
    index = zigzag_index(seq_len, cp_size, cp_rank, device)
    return SequenceContext(seq_len, index, cp_size, cp_rank, group, ranks, comm,
                           None if documents is None else documents.to(device))


# ------------------------------------------------------------------------------ attention


@dataclass(frozen=True)
class SegmentedContext:
    """Dynamic context parallelism (`core.parallel.dynamic_cp_runtime`): this rank's tokens are
    one row of consecutive segments, each the local part of its own sequence spread over its
    own (sub-)group of cp ranks (`SequenceContext`, cp 1 for sequences kept whole here).

    It stands in for a `SequenceContext` in the model: the caller has already laid out the
    local tokens (`split` is the identity), `positions` are theirs, and the loss is normalised
    over the whole cp group (`cp_size`, `group`), which holds every token of the micro-batch
    exactly once. `starts[i]` is where segment i begins in the local row; `documents[i]`, for
    a segment kept whole on this rank, the lengths of its documents in order (each runs alone
    through the causal kernel, so no query-key pair across documents is computed), else None.
    """

    segments: tuple[SequenceContext, ...]
    starts: tuple[int, ...]
    local_positions: torch.Tensor  # (1, T_local)
    cp_size: int
    group: dist.ProcessGroup | None
    documents: tuple[tuple[int, ...] | None, ...] = ()

    def positions(self, batch: int) -> torch.Tensor:
        return self.local_positions

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dropout_p: float, window: int | None = None) -> torch.Tensor:
        """Each segment's attention over its own group, in segment order (the same order on
        every rank, so the groups' collectives never cross), concatenated along the tokens.
        Raises NotImplementedError for a sliding `window` (dynamic cp runs full attention)."""
        if window is not None:
            raise NotImplementedError(f"dynamic context parallelism does not support "
                                      f"sliding_window={window}; use a fixed cp size")
        if not self.segments:  # nothing placed here this micro-batch
            return q * 0.0
        outs = []
        docs = self.documents or (None,) * len(self.segments)
        for start, seg, lengths in zip(self.starts, self.segments, docs):
            if lengths is not None:  # whole documents: each alone, causal
                for n in lengths:
                    outs.append(F.scaled_dot_product_attention(
                        q[:, :, start:start + n], k[:, :, start:start + n],
                        v[:, :, start:start + n], dropout_p=dropout_p, is_causal=True,
                        enable_gqa=True))
                    start += n
                continue
            n = seg.index.numel()
            outs.append(attention(q[:, :, start:start + n], k[:, :, start:start + n],
                                  v[:, :, start:start + n], seg, dropout_p))
        return torch.cat(outs, dim=2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              seq: SequenceContext | SegmentedContext, dropout_p: float = 0.0,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of the local queries `q (B, H, T_local, D)` against the keys and values
    of the whole sequence (`k`, `v`: `(B, H_kv, T_local, D)` local; grouped-query heads when
    H_kv < H), masked by global index, document and sliding `window`. Returns
    `(B, H, T_local, D)`."""
    if isinstance(seq, SegmentedContext):
        return seq.attention(q, k, v, dropout_p, window)
    if seq.cp_size > 1 and seq.comm == "ring":
        seed = int(torch.randint(0, 2**62, ())) if dropout_p else 0  # this rank's generator
        return _RingAttention.apply(q, k, v, seq, dropout_p, seed, window)
    if seq.cp_size > 1:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        # (B, H, T, D) -> gather whole blocks in cp-rank order along the sequence dim.
        k = all_gather_single_autograd(k.contiguous(), gather_dim=2, group=seq.group)
        v = all_gather_single_autograd(v.contiguous(), gather_dim=2, group=seq.group)
        key_index = torch.cat([seq.rank_index(r) for r in range(seq.cp_size)])
    else:
        key_index = seq.index
    mask = seq.mask(key_index, window).unsqueeze(1)  # (B or 1, 1, Tq, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=True)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two softmax-normalized partial attentions over disjoint key sets, each with the
    log-sum-exp of its scores (`-inf` where a row saw no key): the attention over the union and
    its log-sum-exp. `out (..., T, D)`, `lse (..., T)`."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w1, w2 = torch.exp(lse - safe), torch.exp(block_lse - safe)
    return out * w1.unsqueeze(-1) + block_out * w2.unsqueeze(-1), new


def _scores(q5: torch.Tensor, kb: torch.Tensor, mask: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """Masked scores `(B, Hkv, G, Tq, Tk)` of grouped queries `q5 (B, Hkv, G, Tq, D)`."""
    s = torch.einsum("bkgqd,bktd->bkgqt", q5, kb) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def block_attention(q5: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor,
                    scale: float, keep: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over one key block: (output, log-sum-exp); rows with no
    visible key give output 0 and log-sum-exp -inf. `keep`: attention dropout, the kept
    probabilities already scaled (`dropout_scale`); the log-sum-exp is the undropped one, so
    partial results still merge exactly (`merge_partials` is linear in the outputs)."""
    s = _scores(q5, kb, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~mask[:, None, None], 0.0)
    if keep is not None:
        p = p * keep
    return torch.einsum("bkgqt,bktd->bkgqd", p, vb), lse


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _wrap(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - 2**64 if c >= 2**63 else c


def dropout_scale(seed: int, p: float, shape: tuple[int, int, int], q_index: torch.Tensor,
                  k_index: torch.Tensor) -> torch.Tensor:
    """The ring's attention-dropout multipliers `(B, Hkv, G, Tq, Tk)`: 0 for a dropped
    probability, 1 / (1 - p) for a kept one. Each is a hash of (seed, row, head, GLOBAL query
    index, GLOBAL key index) (splitmix64), not a draw from a stream: the same seed gives the
    same mask whichever cp rank and ring step computes a pair, so forward and backward agree
    and the result does not depend on the split. Its statistics are those of dropout (each
    pair kept with probability 1 - p, independently); it is not the mask SDPA draws."""
    B, Hkv, G = shape
    dev = q_index.device
    x = (torch.arange(B, device=dev).view(B, 1, 1, 1, 1) * _wrap(_MIX[1])
         + torch.arange(Hkv * G, device=dev).view(1, Hkv, G, 1, 1) * _wrap(_MIX[2])
         + q_index.view(1, 1, 1, -1, 1) * (2**32 + 15) + k_index.view(1, 1, 1, 1, -1)
         + _wrap(seed * _MIX[0] % 2**64))
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2])):  # splitmix64's finaliser
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * _wrap(mult)
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    uniform = (x & ((1 << 24) - 1)).float() / 2**24  # 24 bits: enough for a probability
    return (uniform >= p).float() / (1.0 - p)


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to cp rank + 1, receive from
    cp rank - 1. Distinct tags keep K/V blocks and gradient accumulators apart."""

    def __init__(self, seq: SequenceContext) -> None:
        self.seq = seq
        self.next = seq.ranks[(seq.cp_rank + 1) % seq.cp_size]
        self.prev = seq.ranks[(seq.cp_rank - 1) % seq.cp_size]
        self.sends: list[dist.Work] = []

    def shift(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, dist.Work]:
        """Start sending `t` on and receiving the previous rank's; (buffer, its receive)."""
        buf = torch.empty_like(t)
        recv = dist.irecv(buf, src=self.prev, group=self.seq.group, tag=tag)
        self.sends.append(dist.isend(t.contiguous(), dst=self.next, group=self.seq.group,
                                     tag=tag))
        return buf, recv

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        self.sends.clear()


_KV_TAG, _GRAD_TAG = 17, 18


def visible_block(step: int, src: int, cp_rank: int, half: int) -> tuple[slice, slice]:
    """The (local queries, keys of `src`'s block) that can see each other at ring step `step`
    under the zigzag split (`zigzag_index`; `half` = one chunk); every other pair is above the
    causal diagonal, so it is never computed. Step 0 is the own block (causal within it). A
    block from an earlier rank (src < cp_rank) is seen only through its first chunk (its second
    lies after both of ours); from a later rank, only our second chunk (it lies after both of
    its chunks) sees it, and our first chunk sees none of it. Either way half the block."""
    if step == 0:
        return slice(None), slice(None)
    if src < cp_rank:
        return slice(None), slice(0, half)
    return slice(half, None), slice(None)


class _RingAttention(torch.autograd.Function):
    """Ring attention (see the module docstring). Computes in fp32 (fp64 stays fp64). With
    cp 1 it runs its one block without communicating (how its formulas are unit-tested)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seq: SequenceContext, dropout_p: float = 0.0, seed: int = 0,
                window: int | None = None) -> torch.Tensor:
        dtype = torch.promote_types(q.dtype, torch.float32)
        B, H, Tq, D = q.shape
        Hkv = k.shape[1]
        scale = 1.0 / math.sqrt(D)
        q5 = q.to(dtype).reshape(B, Hkv, H // Hkv, Tq, D)
        kv = torch.stack([k.to(dtype), v.to(dtype)])
        ring, cp = _Ring(seq), seq.cp_size
        out = lse = None
        for step in range(cp):
            if step < cp - 1:
                nxt, recv = ring.shift(kv, _KV_TAG)  # in flight while this block computes
            src = (seq.cp_rank - step) % cp
            qs, ks = visible_block(step, src, seq.cp_rank, Tq // 2)
            key_index = seq.rank_index(src)[ks]
            mask = seq.mask(key_index, window)[:, qs]
            keep = (dropout_scale(seed, dropout_p, (B, Hkv, H // Hkv), seq.index[qs], key_index)
                    if dropout_p else None)
            block_out, block_lse = block_attention(q5[:, :, :, qs], kv[0][:, :, ks],
                                                   kv[1][:, :, ks], mask, scale, keep)
            if out is None:  # step 0: every query
                out, lse = block_out, block_lse
            else:
                out[:, :, :, qs], lse[..., qs] = merge_partials(
                    out[:, :, :, qs], lse[..., qs], block_out, block_lse)
            if step < cp - 1:
                recv.wait()
                kv = nxt
        ring.finish()
        ctx.seq, ctx.scale, ctx.in_dtype, ctx.dropout = seq, scale, q.dtype, (dropout_p, seed)
        ctx.window = window
        ctx.save_for_backward(q5, k.to(dtype), v.to(dtype), out, lse)
        return out.reshape(B, H, Tq, D).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        seq, scale, (dropout_p, seed) = ctx.seq, ctx.scale, ctx.dropout
        q5, k, v, out, lse = ctx.saved_tensors
        B, Hkv, G, Tq, D = q5.shape
        do5 = grad_out.to(q5.dtype).reshape(B, Hkv, G, Tq, D)
        delta = (do5 * out).sum(-1)  # (B, Hkv, G, Tq)
        dq5 = torch.zeros_like(q5)
        ring, cp = _Ring(seq), seq.cp_size
        kv = torch.stack([k, v])
        acc_recv = None
        for step in range(cp):
            if step < cp - 1:
                nxt, recv = ring.shift(kv, _KV_TAG)
            src = (seq.cp_rank - step) % cp
            qs, ks = visible_block(step, src, seq.cp_rank, Tq // 2)
            key_index = seq.rank_index(src)[ks]
            mask = seq.mask(key_index, ctx.window)[:, qs]
            q_sub, do_sub, kb, vb = q5[:, :, :, qs], do5[:, :, :, qs], kv[0][:, :, ks], kv[1][:, :, ks]
            s = _scores(q_sub, kb, mask, scale)
            p = torch.exp(s - lse[..., qs].unsqueeze(-1)).masked_fill(~mask[:, None, None], 0.0)
            dp = torch.einsum("bkgqd,bktd->bkgqt", do_sub, vb)
            p_used = p  # the probabilities the output was made of (dropped and rescaled)
            if dropout_p:  # dP = (dO V^T) * keep; delta = rowsum(dO * O) still holds
                keep = dropout_scale(seed, dropout_p, (B, Hkv, G), seq.index[qs], key_index)
                dp, p_used = dp * keep, p * keep
            ds = p * (dp - delta[..., qs].unsqueeze(-1))
            dq5[:, :, :, qs] += torch.einsum("bkgqt,bktd->bkgqd", ds, kb) * scale
            acc = torch.zeros_like(kv)  # this block's (dk, dv); skipped keys get none
            acc[0][:, :, ks] = torch.einsum("bkgqt,bkgqd->bktd", ds, q_sub) * scale
            acc[1][:, :, ks] = torch.einsum("bkgqt,bkgqd->bktd", p_used, do_sub)
            if acc_recv is not None:  # what the ranks before us added to this block
                buf, work = acc_recv
                work.wait()
                acc = acc + buf
            if cp == 1:  # one block, our own (the unit tests run the formulas this way)
                buf = acc
                break
            # Pass the block's gradient on; after a full turn it reaches the block's owner.
            acc_recv = ring.shift(acc, _GRAD_TAG)
            if step < cp - 1:
                recv.wait()
                kv = nxt
        if cp > 1:
            buf, work = acc_recv
            work.wait()
        ring.finish()
        dq = dq5.reshape(B, Hkv * G, Tq, D).to(ctx.in_dtype)
        return dq, buf[0].to(ctx.in_dtype), buf[1].to(ctx.in_dtype), None, None, None, None


# ---------------------------------------------------------------------------------- loss


def global_mean_loss(loss_sum: torch.Tensor, count: torch.Tensor, cp_size: int,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean loss over the whole sequence from this cp rank's `loss_sum` over its `count`
    labelled tokens.

    Its value is the global mean on every cp rank (sums and counts all-reduced over cp). Its
    gradient is that of `cp * loss_sum / global_count`: the data-parallel reduction averages
    over dp x cp ranks, and the average over cp of these is the global mean's gradient.
    """
    if cp_size == 1:
        return loss_sum / count.clamp(min=1)
    totals = torch.stack([loss_sum.detach().float(), count.float()])
    dist.all_reduce(totals, group=group)
    total_count = totals[1].clamp(min=1)
    surrogate = loss_sum * cp_size / total_count
    return surrogate + (totals[0] / total_count - surrogate).detach()
