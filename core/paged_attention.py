"""One-token (decode) attention over a paged KV pool, read through each row's block table.

`paged_decode_attention(q, keys, values, tables, positions, kernel)`: row b's query attends to
the keys of its blocks `tables[b]` (logical order), positions `0..positions[b]` only. The pool
is a layer's `(num_blocks, block_size, kv_heads, head_dim)` tensor of `core.paged_kv_cache`.
Two kernels, one result (to rounding):

- "gather": each row's blocks are copied into a contiguous prefix (the whole table's width, so
  the shapes do not depend on the lengths) and attended with a mask. Any device; the CPU path.
- "flex": FlexAttention (`torch.nn.attention.flex_attention`) over the whole pool as one key
  sequence, with a block mask built from the tables: each row's query sees only its own blocks'
  tokens up to its position, and blocks no row of a query tile owns are skipped, so nothing is
  gathered. Its launch depends on the pool's size, not on the rows' lengths. Meant compiled on
  CUDA; uncompiled it runs torch's reference implementation (slow: tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.core.sliding_window import in_window

KERNELS = ("gather", "flex")


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of each row's blocks `tables (B, W)` of a pool
    `(num_blocks, block_size, nkv, hd)`, as `(B, nkv, length, hd)`: one copy (the gather),
    then a view."""
    B, W = tables.shape
    rows = pool[tables].view(B, W * pool.shape[1], pool.shape[2], pool.shape[3])
    return rows[:, :length].transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           tables: torch.Tensor, positions: torch.Tensor,
                           kernel: str = "gather", window: int | None = None) -> torch.Tensor:
    """Attention output `(B, heads, 1, head_dim)` for queries `q (B, heads, 1, head_dim)`;
    `tables (B, W)` long, `positions (B,)` long (each row's position, < W * block_size).
    Heads are grouped over the pool's kv heads (heads % kv_heads == 0). `window`: a sliding
    window (`core.sliding_window`): each row sees only its last `window` positions, so table
    entries before them may name any block (the scratch block once freed)."""
    if q.ndim != 4 or q.shape[2] != 1:
        raise ValueError(f"paged decode attention takes one query per row (B, heads, 1, dim), "
                         f"got {tuple(q.shape)}")
    if kernel == "gather":
        return _gather(q, keys, values, tables, positions, window)
    if kernel == "flex":
        return _flex(q, keys, values, tables, positions, window)
    raise ValueError(f"unknown paged attention kernel {kernel!r}: choose one of {KERNELS}")


def _gather(q, keys, values, tables, positions, window):
    length = tables.shape[1] * keys.shape[1]
    k = gather_blocks(keys, tables, length).to(q.dtype)
    v = gather_blocks(values, tables, length).to(q.dtype)
    key_pos = torch.arange(length, device=q.device).view(1, 1, 1, length)
    mask = key_pos <= positions.view(-1, 1, 1, 1)
    if window is not None:
        mask = mask & in_window(positions.view(-1, 1, 1), key_pos, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def block_owners(tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`(B, num_blocks)` long: where each pool block sits in row b's table (its logical block
    index), -1 where the row does not hold it. A block named twice in a row (the scratch
    block padding a table) gets one of its indices: past the row's blocks, so masked anyway."""
    B, W = tables.shape
    owners = torch.full((B, num_blocks), -1, dtype=torch.long, device=tables.device)
    return owners.scatter_(1, tables, torch.arange(W, device=tables.device).expand(B, W))


def _flex(q, keys, values, tables, positions, window):
    mask = flex_block_mask(tables, positions, keys.shape[0], keys.shape[1], window)
    return flex_decode(q, keys, values, mask)


def flex_block_mask(tables: torch.Tensor, positions: torch.Tensor, num_blocks: int,
                    block_size: int, window: int | None = None):
    """FlexAttention's `BlockMask` for rows with block `tables (B, W)` at `positions (B,)` over
    a pool of `num_blocks` blocks: one per pass and window, shared by the layers with that
    sliding `window` (None: the whole context) (`flex_decode`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    owners = block_owners(tables, num_blocks)

    def visible(b, h, q_idx, kv_idx):
        logical = owners[q_idx, kv_idx // block_size]
        key_pos = logical * block_size + kv_idx % block_size
        seen = (logical >= 0) & (key_pos <= positions[q_idx])
        if window is None:
            return seen
        return seen & (positions[q_idx] - key_pos < window)

    B = tables.shape[0]
    return create_block_mask(visible, None, None, B, num_blocks * block_size,
                             device=tables.device, BLOCK_SIZE=(B, block_size))


def flex_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                block_mask) -> torch.Tensor:
    """`paged_decode_attention(..., "flex")` with the pass's `flex_block_mask`."""
    from torch.nn.attention.flex_attention import flex_attention

    num_blocks, block_size, nkv, hd = keys.shape
    total = num_blocks * block_size
    # Rows become the query sequence of one batch; the pool is one key sequence.
    qs = q.transpose(0, 2)  # (1, H, B, hd)
    k = keys.view(total, nkv, hd).transpose(0, 1).unsqueeze(0).to(q.dtype)
    v = values.view(total, nkv, hd).transpose(0, 1).unsqueeze(0).to(q.dtype)
    out = flex_attention(qs, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != nkv)
    return out.transpose(0, 2)  # (B, H, 1, hd)
