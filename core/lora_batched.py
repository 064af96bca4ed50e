"""Many LoRA adapters on one model at once: slot-stacked factors and a per-row batched product.

Serving applies adapters without merging them, so requests of different adapters (and plain
ones) share a forward pass. Each targeted `ParallelLinear` gets a `StackedLoRA` hook holding
`A (slots, r_max, in_local)` and `B (slots, out_local, r_max)`: slot s holds one adapter's
factors, this rank's tensor-parallel pieces (cut as `core.lora.attach_lora` cuts them: B by rows
on a column base, A by columns on a row base, the row base's partial product joining the
layer's own all-reduce), its scale folded into B, and a module rank below `r_max` padded with
zeros (zero rows of A and zero columns of B add exactly nothing). Loading an adapter is a copy
into a free slot; unloading zeroes it. Nothing is rebuilt, nothing is merged.

Which slot each batch row uses comes from one `AdapterRows` shared by every hook of the model,
set once per forward (`AdapterRows.set`): `(B,)` slots, -1 for a row without an adapter (it
adds nothing). The product loops over the few distinct adapters of the batch, never over
tokens: per adapter, the rows that use it are gathered, multiplied by its two factors and added
back (`index_add_`). Measured against gathering every row's factors and one pair of `bmm`s, on
CPU (AVX2) the loop was as fast or faster at every size tried (`bench/bench_lora_batched.py`),
and it reads each adapter's factors once instead of once per row.

Exactness: a row with adapter X computes `W x + s B_X A_X x`, the same product as
`core.lora.LoRA`, which equals the merged model to rounding (fp32: ~1e-6 relative).
"""

from __future__ import annotations

import torch

from tessera.core.parallel.layers import ParallelLinear


class AdapterRows:
    """Each batch row's adapter slot for the next forward pass, shared by every hook."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, batch rows that use it)
        self.per_row: torch.Tensor | None = None  # see `set_per_row`

    def set(self, slots: torch.Tensor | None) -> None:
        """`slots (B,)` long, -1 for none; None when no row uses an adapter."""
        self.groups, self.per_row = [], None
        if slots is None:
            return
        values = slots.tolist()
        for slot in sorted(set(values) - {-1}):
            rows = [i for i, v in enumerate(values) if v == slot]
            self.groups.append((slot, torch.tensor(rows, dtype=torch.long,
                                                   device=slots.device)))

    def set_per_row(self, slots: torch.Tensor) -> None:
        """`slots (B,)` long, -1 for none, read on the device only: every row gathers its own
        adapter's factors. No host read and no shape that depends on the slots, so a
        compiled (or CUDA-graph) step serves any mix of adapters with one graph; it reads the
        factors once per row rather than once per adapter."""
        self.groups, self.per_row = [], slots


class StackedLoRA:
    """The adapter hook of a `ParallelLinear` serving up to `slots` adapters (module docstring).

    `a (slots, r_max, in_local)`, `b (slots, out_local, r_max)` in the layer's dtype, scale
    folded into `b`. Input `x` is `(T, B, in_local)` (the model's sequence-first layout)."""

    def __init__(self, layer: ParallelLinear, slots: int, max_rank: int, rows: AdapterRows):
        weight = layer.weight
        out_local, in_local = weight.shape[0], weight.shape[1]
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        self.a = torch.zeros(slots, max_rank, in_local, dtype=dtype, device=weight.device)
        self.b = torch.zeros(slots, out_local, max_rank, dtype=dtype, device=weight.device)
        self.rows = rows

    @torch.no_grad()
    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
            scaling: float) -> None:
        """Copy this rank's pieces `a (r, in_local)`, `b (out_local, r)` into `slot` (zeros
        elsewhere); None clears the slot (the adapter does not adapt this module)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        if r > self.a.shape[1]:
            raise ValueError(f"a LoRA factor of rank {r} does not fit max rank {self.a.shape[1]}")
        if a.shape[1] != self.a.shape[2] or b.shape[0] != self.b.shape[1] or b.shape[1] != r:
            raise ValueError(f"LoRA pieces {tuple(a.shape)} / {tuple(b.shape)} do not fit this "
                             f"layer's {tuple(self.b.shape[1:2]) + tuple(self.a.shape[2:])}")
        self.a[slot, :r] = a.to(self.a.dtype)
        self.b[slot, :, :r] = (b.float() * scaling).to(self.b.dtype)

    def __call__(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor | float:
        if self.rows.per_row is not None:
            return self._per_row(x, self.rows.per_row)
        if not self.rows.groups:
            return 0.0
        out = x.new_zeros(*x.shape[:-1], self.b.shape[1])
        for slot, rows in self.rows.groups:
            xs = x.index_select(1, rows)
            delta = (xs @ self.a[slot].to(x.dtype).t()) @ self.b[slot].to(x.dtype).t()
            out.index_add_(1, rows, delta)
        return out

    def _per_row(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The product with each row's own factors (`AdapterRows.set_per_row`); rows of slot -1
        add zeros."""
        which = slots.clamp(min=0)
        a = self.a[which].to(x.dtype)  # (B, r, in)
        b = self.b[which].to(x.dtype) * (slots >= 0).to(x.dtype).view(-1, 1, 1)  # (B, out, r)
        return torch.einsum("tbr,bor->tbo", torch.einsum("tbi,bri->tbr", x, a), b)
