"""Count the host synchronisations a block of code would make on a GPU, on any device.

On CUDA a value read on the host waits for the device: a scalar read (`.item()`, `int(t)`,
`bool(t)`, `float(t)`), `.tolist()`, `torch.equal`, `nonzero` (its output's size is data), and
a copy to the CPU. Not seen on the CPU: copies from pageable host memory to the GPU (the GPU
test of the same code runs under `torch.cuda.set_sync_debug_mode` for those). On a CPU tensor these
cost nothing and some of them never reach the dispatcher (`.tolist()`, `.cpu()`), so the
counter sees the dispatched ones with a `TorchDispatchMode` and wraps the others on
`torch.Tensor` while it is active. Every such call counts, whatever its tensor's device: host
code that should not count must keep its values in Python (lists, ints), as the engine's step
preparation does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                 torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default,
                 torch.ops.aten.nonzero.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_WRAPPED = ("tolist", "cpu", "numpy")  # host reads that a CPU tensor serves without dispatch


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as syncs: ...`, then `syncs.total` and `syncs.calls` (name -> count).
    Set `syncs.label` (e.g. to a step number) to tag what is counted from then on;
    `syncs.count_for(label)` counts one label's calls, `syncs.events` lists (label, name)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.events: list[tuple[object, str]] = []
        self.label: object = None
        self._depth = 0  # a wrapped `.tolist()` dispatches reads of its own: count it once

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def count_for(self, label: object) -> int:
        return sum(1 for seen, _ in self.events if seen == label)

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        self.events.append((self.label, name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth == 0:
            if func in _SCALAR_READS:
                self._count(str(func.overloadpacket.__name__))
            elif func in _COPIES and _to_host(func, args, kwargs):
                self._count("copy to host")
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncs:
        super().__enter__()
        self._saved = {name: getattr(torch.Tensor, name) for name in _WRAPPED}
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, self._counting(name, method))
        return self

    def __exit__(self, *exc) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        super().__exit__(*exc)

    def _counting(self, name, method):
        def wrapper(tensor, *args, **kwargs):
            if self._depth == 0:
                self._count(name)
            self._depth += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper


def _to_host(func, args, kwargs) -> bool:
    """Whether a copy moves data from another device to the CPU."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" \
        and args[0].device.type != "cpu"


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """The counter as a context manager (see `HostSyncs`)."""
    with HostSyncs() as syncs:
        yield syncs
