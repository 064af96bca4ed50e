"""The engine's per-request LoRA operations: load and unload adapters while serving (on every
rank), and bind each request to its adapter's slot.

`AdapterOps` is composed into the engine: it holds the runner's `AdapterRegistry` (None when
the engine serves no adapters), the executor (to reach the other ranks) and the names of the
prompt-tuned tasks (adapter names must not shadow them). The step loop only meets it when a
request arrives (`bind`); each row's slot then travels in `EngineRequest.adapter`.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from tessera.core.lora_format import AdapterError
from tessera.serving.engine.adapters import AdapterRegistry, UnknownAdapter
from tessera.serving.engine.executor import Executor, LocalExecutor
from tessera.serving.types import RequestError


class AdapterOps:
    """Per-request LoRA for one engine (module docstring)."""

    def __init__(self, registry: AdapterRegistry | None, executor: Executor,
                 task_names: Collection[str]):
        self.registry, self.executor, self.task_names = registry, executor, task_names

    def names(self) -> list[str]:
        """The LoRA adapters loaded now (`serving.engine.adapters`), by name."""
        return self.registry.names() if self.registry is not None else []

    def load(self, name: str, path: str | Path) -> str:
        """Load the adapter directory `path` as `name` while serving; returns its ident. Over
        several ranks, every rank loads it (from `path` on its own machine) before the next
        step; call it then from another thread than the step loop's.

        Raises `AdapterError` (not served with adapters, a bad adapter, a name taken by a
        task) or `AdapterBusy` (name loaded, no free slot)."""
        registry = self._registry()
        if name in self.task_names:
            raise AdapterError(f"{name!r} is a prompt-tuned task of this server; give the "
                               "adapter another name")
        if isinstance(self.executor, LocalExecutor):
            return registry.load(name, path)
        registry.check_room(name)  # rank 0's answer (409) before the ranks try
        self._on_every_rank("load", name, str(path))
        return registry.ident_of(name)

    def unload(self, name: str) -> None:
        """Free adapter `name`'s slot (on every rank). Raises `UnknownAdapter`, or
        `AdapterBusy` while unfinished requests use it (unload again once they are done)."""
        registry = self._registry()
        if isinstance(self.executor, LocalExecutor):
            registry.unload(name)
        else:
            self._on_every_rank("unload", name, None)

    def bind(self, seq: Any) -> str:
        """Point `seq` (an `EngineRequest`) at its adapter's slot (counted as in use); returns
        the load's ident. Raises `RequestError` for an adapter that is not loaded."""
        name = seq.request.adapter
        if self.registry is None:
            raise RequestError(f"no LoRA adapter named {name!r}: this server serves none")
        try:
            seq.adapter, ident = self.registry.acquire(name, seq)
        except UnknownAdapter as exc:
            raise RequestError(str(exc)) from None
        return ident

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
        if self.registry is None:
            raise AdapterError("this engine serves no LoRA adapters: start it with --lora "
                               "NAME=PATH or --allow-runtime-lora (a ModelRunner with lora=...)")
        return self.registry
