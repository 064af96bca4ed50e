"""Sliding-window attention masks (Mistral, Qwen2): which keys a query may see.

A query at position i sees the keys at positions j with `i - window < j <= i`: `window` keys,
its own included, as Hugging Face transformers' masks count them. Positions are absolute
(token indices of the sequence, or of a KV cache's row).
"""

from __future__ import annotations

import torch


def in_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Booleans `query_pos[..., None] - key_pos < window` (the window's lower edge only; the
    causal edge `key_pos <= query_pos` is the caller's mask)."""
    return query_pos.unsqueeze(-1) - key_pos < window


def causal_window_mask(length: int, window: int, device: torch.device | str) -> torch.Tensor:
    """`(length, length)` booleans of causal attention limited to `window` keys per query."""
    pos = torch.arange(length, device=device)
    return (pos[None, :] <= pos[:, None]) & in_window(pos, pos, window)


def first_visible(position: int, window: int | None) -> int:
    """The first key position a query at `position` sees (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)
