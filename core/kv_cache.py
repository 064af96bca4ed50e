"""A preallocated key/value cache addressed by slot, for iteration-level batching.

Each running sequence owns one *slot* (a row of the cache). A forward pass gives, per row of its
batch, the slot and the absolute positions of its new tokens; keys and values are written there
and attention reads the slot's prefix up to the largest position in the batch, masked so each
query sees only positions <= its own. Rows of one batch may therefore have different lengths
(prefill of one request next to decode steps of others).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.core.paged_kv_cache import PagedKVCache


class KVCache:
    """Keys and values for the layers `layer_ids`, shape `(slots, kv_heads, max_seq, head_dim)`
    (values `value_dim` wide instead when given: `core.parallel.sharding.kv_geometry`)."""

    attends = False  # attention runs over the keys `update` returns (see PagedKVCache.attend)

    def __init__(self, layer_ids: list[int], num_slots: int, max_seq: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", value_dim: int | None = None):
        shape = (num_slots, kv_heads, max_seq, head_dim)
        value_shape = shape[:-1] + (value_dim or head_dim,)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(value_shape, dtype=dtype, device=device) for i in layer_ids}
        self.num_slots, self.max_seq = num_slots, max_seq
        self._pass: tuple[int, int | None, torch.Tensor] | None = None

    def begin(self, positions: torch.Tensor, slots: torch.Tensor, views: bool = True,
              length: int | None = None) -> None:
        """Plan the forward pass that writes `positions (B, T)` of `slots (B,)`.

        Every layer's `update` in that pass uses the plan: the prefix length to read, the first
        slot if the slots are consecutive (else None), and the attention mask. Its checks read
        tensor values (a device sync each), so they run once per pass and stage, in
        `GPTModel.forward` before the layers, which also keeps them out of a compiled decode
        step (`serving.engine.compiled`).
        `views=False` always gathers: then the pass does not depend on which slots it reads
        (a compiled graph would be specialized to the first slot's number otherwise).
        `length`: the largest position + 1 when the caller knows it on the host (else read).
        """
        if length is None:
            length = int(positions.max()) + 1
        if length > self.max_seq:
            raise ValueError(f"position {length - 1} exceeds the cache length {self.max_seq}")
        first: int | None = int(slots[0]) if views else None
        if first is not None:
            consecutive = torch.arange(first, first + len(slots), device=slots.device)
            if not bool((slots == consecutive).all()):
                first = None
        key_pos = torch.arange(length, device=positions.device)
        mask = key_pos.view(1, 1, 1, length) <= positions.view(*positions.shape, 1).unsqueeze(1)
        self._pass = (length, first, mask)

    @property
    def pass_length(self) -> int:
        """The prefix length the planned pass reads (its largest position + 1)."""
        if self._pass is None:
            raise RuntimeError("no pass planned: call KVCache.begin(positions, slots)")
        return self._pass[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values)
                   for t in d.values())

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new `k, v (B, nkv, T, hd)` at `positions (B, T)` of `slots (B,)`.

        Returns all keys and values of those slots up to the largest position, and the boolean
        attention mask `(B, 1, T, L)` (True = attend). `begin` must have planned this pass.
        """
        if self._pass is None:
            raise RuntimeError("KVCache.update before KVCache.begin(positions, slots)")
        length, first, mask = self._pass
        if mask.shape[0] != k.shape[0] or mask.shape[2] != k.shape[2]:
            # The plan of an earlier pass, left over: its mask would silently mislead.
            raise RuntimeError(f"KVCache.update of {k.shape[0]} rows x {k.shape[2]} tokens, but "
                               f"the planned pass has {mask.shape[0]} x {mask.shape[2]}: call "
                               "KVCache.begin(positions, slots) for every pass")
        return self.store_and_read(self.keys[layer], self.values[layer], k, v, positions, slots)

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s keys and values as a cache of their own (see `LayerKV`)."""
        return LayerKV(self, self.keys[layer], self.values[layer])

    def store_and_read(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`update` on one layer's `keys` and `values` (tensors of this cache)."""
        length, first, mask = self._pass  # type: ignore[misc]  # update checked the plan
        rows = slots.unsqueeze(1)  # (B, 1) broadcast against positions (B, T)
        keys[rows, :, positions] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, positions] = v.transpose(1, 2).to(values.dtype)
        if first is not None:
            # Consecutive slots (the engine keeps them so): a view, no copy of every prefix.
            keys = keys[first:first + len(slots), :, :length]
            values = values[first:first + len(slots), :, :length]
        else:
            keys = keys[slots, :, :length]
            values = values[slots, :, :length]
        return keys.to(k.dtype), values.to(v.dtype), mask


class LayerKV:
    """One layer of a cache (`KVCache` or `core.paged_kv_cache.PagedKVCache`) under the cache's
    planned pass: `update(layer, ...)` stores into and reads from this layer's tensors whatever
    `layer` it is given.

    What a compiled transformer block is handed instead of the whole cache: the block then
    reads no layer number, so one compiled graph serves every layer (the layer's tensors are
    graph inputs, like its parameters), where indexing the cache by layer would specialize the
    graph to each layer's number.
    """

    def __init__(self, cache: KVCache | PagedKVCache, keys: torch.Tensor, values: torch.Tensor):
        self.cache, self.keys, self.values = cache, keys, values

    @property
    def attends(self) -> bool:
        return self.cache.attends

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.store_and_read(self.keys, self.values, k, v, positions, rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rows: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        return self.cache.store_and_attend(  # type: ignore[union-attr]  # only when attends
            self.keys, self.values, q, k, v, positions, rows, window)
