"""Peak bytes of live tensor memory on any device, counted at the dispatcher.

`torch.cuda.max_memory_allocated` exists only on CUDA, and a process's resident size on a CPU
moves with the allocator's caching, not with the tensors alive. `PeakTensorBytes` counts every
storage an operator creates while it is active (autograd's backward included: the mode reaches
the autograd engine) and uncounts it when the storage is freed, so its `peak` is the most
bytes held at once by tensors made under it, exact and repeatable on a CPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorBytes(TorchDispatchMode):
    """A dispatch mode whose `peak` is the most bytes held at once by storages created under it
    (views and in-place results of existing storages add nothing; tensors that existed before
    it are not counted), and `live` the bytes still held."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: set[int] = set()  # data pointers of the counted storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in inputs or ptr in self._held:
            return
        self._held.add(ptr)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, ptr, size)

    def _free(self, ptr: int, size: int) -> None:
        self._held.discard(ptr)
        self.live -= size
