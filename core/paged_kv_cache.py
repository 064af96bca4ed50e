"""A paged key/value cache: fixed-size blocks in one preallocated pool, addressed by block tables.

Each layer's keys (and values) are one tensor `(num_blocks, block_size, kv_heads, head_dim)`:
token-major inside a block, so the blocks a row gathers line up as `(tokens, heads, head_dim)`
and attention reads them through a transposed view, with one copy (the gather) and not two.
A sequence owns a list of blocks, its *block table*: token position `p` lives in block
`table[p // block_size]` at offset `p % block_size`. Who owns which block (allocation, sharing,
eviction) is the caller's business (the server's `serving.engine.block_manager`); this class only
stores and reads.

A forward pass gives, per row of its batch, the absolute positions of its new tokens and its
block table `(B, W)` (padded with any block id). The model passes the tables where a slot cache
takes slots (`GPTModel.forward(..., cache=paged, slots=tables)`), so the model code is the same
for both caches. Keys and values are written through the tables; attention gathers each row's
blocks into a contiguous prefix up to the largest position of the pass and masks it so each
query sees only positions <= its own. This is the CPU path ("a gather"): on CUDA a paged
kernel would read the blocks in place.

Contract on padding: rows shorter than the pass are padded, and the padding's positions
continue past the row's real tokens, so their keys are written too. A table entry past the
blocks a row owns must therefore name a block nobody reads (the server keeps block 0 for
that); an entry inside the row's last, partly filled block is harmless (later tokens overwrite
it, and no query of the row attends that far before they do).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tessera.core.kv_cache import LayerKV
from tessera.core.paged_attention import KERNELS, flex_block_mask, flex_decode, gather_blocks


class PagedKVCache:
    """Keys and values of the layers `layer_ids` in `num_blocks` blocks of `block_size` tokens.

    `max_seq` bounds the positions a pass may hold (the model's context). `windows`: the
    layers' sliding windows (None: whole context), one flex block mask per pass for each.
    `value_dim`: the width of a value head when it differs from a key head's (multi-head
    latent attention, `core.parallel.sharding.kv_geometry`).
    """

    def __init__(self, layer_ids: list[int], num_blocks: int, block_size: int, max_seq: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", decode_attention: str = "gather",
                 windows: Iterable[int | None] = (None,), value_dim: int | None = None):
        if decode_attention not in KERNELS:
            raise ValueError(f"paged decode attention {decode_attention!r} is not one of "
                             f"{', '.join(KERNELS)}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs at least one block of at least one token, "
                             f"got {num_blocks} blocks of {block_size}")
        shape = (num_blocks, block_size, kv_heads, head_dim)
        value_shape = shape[:-1] + (value_dim or head_dim,)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(value_shape, dtype=dtype, device=device) for i in layer_ids}
        self.num_blocks, self.block_size, self.max_seq = num_blocks, block_size, max_seq
        self._pass: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.decode_attention = decode_attention
        self.windows = tuple(dict.fromkeys(windows))
        # The planned one-token pass's block masks by window, with decode_attention "flex".
        self._block_masks: dict[int | None, object] = {}

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, value_dim: int | None = None) -> int:
        """Bytes one block takes over `num_layers` layers (keys and values; values
        `value_dim` wide when given, else `head_dim`)."""
        item = torch.empty((), dtype=dtype).element_size()
        width = head_dim + (value_dim or head_dim)
        return num_layers * kv_heads * block_size * width * item

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values)
                   for t in d.values())

    def begin(self, positions: torch.Tensor, tables: torch.Tensor, views: bool = True,
              length: int | None = None) -> None:
        """Plan the forward pass that writes `positions (B, T)` of the rows with block
        `tables (B, W)`: where each new token goes, which blocks each row reads, the mask.

        Runs once per pass and stage (`GPTModel.forward` calls it), so every layer reuses it.
        `length` is the largest position + 1 when the caller knows it on the host; without it
        it is read from `positions` (a device sync on a GPU). `views` is accepted for the slot
        cache's signature; a paged pass always gathers.
        """
        if tables.ndim != 2:
            raise ValueError(f"a paged cache takes block tables (B, W), got shape "
                             f"{tuple(tables.shape)}")
        if length is None:
            length = int(positions.max()) + 1
        if length > self.max_seq:
            raise ValueError(f"position {length - 1} exceeds the cache length {self.max_seq}")
        width = -(-length // self.block_size)
        if tables.shape[1] < width:
            raise ValueError(f"block tables of {tables.shape[1]} blocks cannot hold position "
                             f"{length - 1} ({width} blocks of {self.block_size} needed)")
        blocks = tables.gather(1, positions // self.block_size)  # (B, T) block of each token
        offsets = positions % self.block_size
        key_pos = torch.arange(length, device=positions.device)
        mask = key_pos.view(1, 1, 1, length) <= positions.view(*positions.shape, 1).unsqueeze(1)
        self._pass = (length, tables[:, :width], blocks, offsets, mask)
        self._block_masks = {}
        if self.decode_attention == "flex" and positions.shape[1] == 1:
            self._block_masks = {w: flex_block_mask(tables[:, :width], positions[:, 0],
                                                    self.num_blocks, self.block_size, w)
                                 for w in self.windows}

    @property
    def attends(self) -> bool:
        """Whether the planned pass's attention runs here (`attend`) rather than over the
        keys `update` returns: one-token passes with `decode_attention="flex"`."""
        return bool(self._block_masks)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, tables: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """Store `k, v` as `update` does and return attention's output `(B, heads, 1, hd)` for
        `q (B, heads, 1, hd)`, read from the blocks in place (`core.paged_attention`)."""
        return self.store_and_attend(self.keys[layer], self.values[layer], q, k, v, positions,
                                     tables, window)

    def store_and_attend(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         tables: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """`attend` on one layer's `keys` and `values` (tensors of this cache); `window`: the
        layer's sliding window, one of `windows`."""
        if self._pass is None or not self._block_masks:
            raise RuntimeError("PagedKVCache.attend needs a one-token pass planned with "
                               "decode_attention='flex' (PagedKVCache.begin)")
        if window not in self._block_masks:
            raise ValueError(f"sliding window {window} is not one of this cache's windows "
                             f"{list(self.windows)}; build the cache with windows=...")
        _, _, blocks, offsets, _ = self._pass
        keys[blocks, offsets] = k.transpose(1, 2).to(keys.dtype)
        values[blocks, offsets] = v.transpose(1, 2).to(values.dtype)
        return flex_decode(q, keys, values, self._block_masks[window])

    @property
    def pass_length(self) -> int:
        """The prefix length the planned pass reads (its largest position + 1)."""
        if self._pass is None:
            raise RuntimeError("no pass planned: call PagedKVCache.begin(positions, tables)")
        return self._pass[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new `k, v (B, nkv, T, hd)` at `positions (B, T)` through the block tables.

        Returns each row's keys and values up to the largest position `(B, nkv, L, hd)`
        (gathered from its blocks) and the boolean attention mask `(B, 1, T, L)`
        (True = attend). `begin` must have planned this pass.
        """
        if self._pass is None:
            raise RuntimeError("PagedKVCache.update before PagedKVCache.begin(positions, tables)")
        length, read, blocks, offsets, mask = self._pass
        if mask.shape[0] != k.shape[0] or mask.shape[2] != k.shape[2]:
            raise RuntimeError(f"PagedKVCache.update of {k.shape[0]} rows x {k.shape[2]} tokens, "
                               f"but the planned pass has {mask.shape[0]} x {mask.shape[2]}: "
                               "call PagedKVCache.begin(positions, tables) for every pass")
        return self.store_and_read(self.keys[layer], self.values[layer], k, v, positions, tables)

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s keys and values as a cache of their own (`core.kv_cache.LayerKV`)."""
        return LayerKV(self, self.keys[layer], self.values[layer])

    def store_and_read(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`update` on one layer's `keys` and `values` (tensors of this cache)."""
        length, read, blocks, offsets, mask = self._pass  # type: ignore[misc]  # checked
        keys[blocks, offsets] = k.transpose(1, 2).to(keys.dtype)  # (B, T, nkv, hd)
        values[blocks, offsets] = v.transpose(1, 2).to(values.dtype)
        return (gather_blocks(keys, read, length).to(k.dtype),
                gather_blocks(values, read, length).to(v.dtype), mask)

