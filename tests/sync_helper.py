"""Count the calls that make the host wait for the device, wherever the tensors are.

    with count_syncs() as syncs:
        ...                         # code under test
    assert syncs.count == 0, syncs.calls

Counted: reading a tensor's value into Python (`float(t)`, `t.item()`, `bool(t)`, `t.tolist()`
on a device tensor, `torch.equal`), ops whose output size depends on the values (`nonzero`),
and copies from a device to the host. On CUDA each of these blocks until the queued kernels
have run; on the CPU they are the same calls, so counting them there shows where a CUDA run
would wait without needing a GPU. (`tolist()` on a CPU tensor reads memory directly and
dispatches nothing, so it is not counted there.) Ops are seen through a `TorchDispatchMode`,
below autograd: the backward's ops on this thread are counted too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result is a host value read from a tensor, or whose size comes from its values.
READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
         aten.equal.default, aten.nonzero.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


class SyncCounter(TorchDispatchMode):
    """A dispatch mode that records the name of every host-waiting call (see the module).
    `label` tags the calls recorded from now on (e.g. the step number); `count_for(label)`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, str]] = []  # (label, op name)
        self.label: Any = None

    @property
    def count(self) -> int:
        return len(self.calls)

    def count_for(self, label: Any) -> int:
        return sum(1 for seen, _ in self.calls if seen == label)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (func in COPIES and _device_to_host(func, args, kwargs)):
            self.calls.append((self.label, str(func)))
        return func(*args, **kwargs)


def _device_to_host(func, args: tuple, kwargs: dict) -> bool:
    if func is aten.copy_.default:  # copy_(dst, src)
        target, src = args[0].device, args[1]
    else:  # _to_copy(src, *, device=...); no device: the same as the source's
        src, target = args[0], kwargs.get("device") or args[0].device
    return src.device.type != "cpu" and torch.device(target).type == "cpu"


@contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """A `SyncCounter` active for the block (see the module)."""
    with SyncCounter() as counter:
        yield counter
