"""The engine's per-request LoRA operations: load and unload adapters while serving (on every
rank), and bind each request's rows to its adapter's slot.

`LLMEngine` inherits these; they read the engine's `adapters` (the runner's
`serving.engine.adapters.AdapterRegistry`, or None when it serves no adapters), `executor` and
`_task_len` (adapter names must not shadow prompt-tuned tasks). Kept apart from the step loop,
which only calls `_bind_adapter` when a request arrives and `_adapter_rows` per forward pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tessera.core.lora_format import AdapterError
from tessera.serving.engine.adapters import AdapterRegistry, UnknownAdapter
from tessera.serving.engine.executor import Executor, LocalExecutor
from tessera.serving.types import RequestError

if TYPE_CHECKING:
    from tessera.serving.engine import _Sequence


class AdapterOps:
    """Mixin of `LLMEngine`: the per-request LoRA operations (module docstring)."""

    adapters: AdapterRegistry | None
    executor: Executor
    _task_len: dict[str, int]

    def adapter_names(self) -> list[str]:
        """The LoRA adapters loaded now (`serving.engine.adapters`), by name."""
        return self.adapters.names() if self.adapters is not None else []

    def load_adapter(self, name: str, path: str | Path) -> str:
        """Load the adapter directory `path` as `name` while serving; returns its ident. Over
        several ranks, every rank loads it (from `path` on its own machine) before the next
        step; call it then from another thread than the step loop's.

        Raises `AdapterError` (not served with adapters, a bad adapter, a name taken by a
        task) or `AdapterBusy` (name loaded, no free slot)."""
        registry = self._registry()
        if name in self._task_len:
            raise AdapterError(f"{name!r} is a prompt-tuned task of this server; give the "
                               "adapter another name")
        if isinstance(self.executor, LocalExecutor):
            return registry.load(name, path)
        registry.check_room(name)  # rank 0's answer (409) before the ranks try
        self._on_every_rank("load", name, str(path))
        return registry.ident_of(name)

    def unload_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot (on every rank). Raises `UnknownAdapter`, or
        `AdapterBusy` while unfinished requests use it (unload again once they are done)."""
        registry = self._registry()
        if isinstance(self.executor, LocalExecutor):
            registry.unload(name)
        else:
            self._on_every_rank("unload", name, None)

    def _on_every_rank(self, op: str, name: str, path: str | None) -> None:
        """A load or unload that the engine thread applies on every rank before its next step
        (`distributed.DistributedExecutor.change_adapters`); waits for it."""
        change = getattr(self.executor, "change_adapters", None)
        if change is None:
            raise AdapterError("this executor cannot change adapters while serving")
        try:
            change(op, name, path).result(timeout=300)
        except TimeoutError:
            raise AdapterError(f"the ranks did not {op} adapter {name!r} within 300 s "
                               "(is the engine running?)") from None

    def _registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise AdapterError("this engine serves no LoRA adapters: start it with --lora "
                               "NAME=PATH or --allow-runtime-lora (a ModelRunner with lora=...)")
        return self.adapters

    def _bind_adapter(self, seq: _Sequence) -> str:
        """Point `seq` at its adapter's slot (counted as in use); the load's ident."""
        name = seq.request.adapter
        if self.adapters is None:
            raise RequestError(f"no LoRA adapter named {name!r}: this server serves none")
        try:
            seq.adapter, ident = self.adapters.acquire(name, seq)
        except UnknownAdapter as exc:
            raise RequestError(str(exc)) from None
        return ident

    def _adapter_rows(self, group: list[tuple[_Sequence, int]]) -> torch.Tensor | None:
        """`StepBatch.adapters` of a group: each row's slot, None when no row has one."""
        if all(s.adapter < 0 for s, _ in group):
            return None
        return torch.tensor([s.adapter for s, _ in group], dtype=torch.long)
