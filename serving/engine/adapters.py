"""Per-request LoRA adapters: a fixed number of slots, loaded and unloaded while serving.

`AdapterRegistry` (one per rank, built by `ModelRunner` from a `LoRAServing`) gives every
adaptable linear layer this rank holds (`core.lora.adaptable_modules`: each block's qkv, wo, w1,
w2) a `core.lora_batched.StackedLoRA` hook with `max_loras` slots of rank `max_rank`. Loading an
adapter reads it (a Tessera adapter directory, or a PEFT one through the reader `tessera serve`
passes in), checks it was tuned on the served base (`core.lora_format.check_base`), and copies
this rank's tensor-parallel pieces into a free slot; unloading frees the slot. Neither touches
the model's weights, and neither waits for the engine.

Names: an adapter's name is what clients select (`BASE:NAME` or `NAME` as the OpenAI model,
`/v2/models/BASE:NAME/...`, the `adapter` field); it may not contain ':' or '/' or whitespace.
Each load gets an `ident`, the sha256 of its scale and factors: the prefix cache keys KV blocks
by it, so an adapter reloaded under the same name with other weights never meets KV computed
with the old ones (and identical weights may share it, which is exact).

In use: the engine registers each request with the slot it uses (`acquire`); an adapter with
unfinished requests is not unloaded (`AdapterBusy`, answered 409): unload it again once they are
done. Thread safety: every method takes the registry's lock; loads copy into a slot no running
row reads, so the engine thread needs no pause.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tessera.core.lora import adaptable_modules
from tessera.core.lora_batched import AdapterRows, StackedLoRA
from tessera.core.lora_format import (
    CONFIG_FILE,
    AdapterConfig,
    AdapterError,
    check_base,
    load_adapter,
    lora_names,
)
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.parallel.sharding import shard_tensor

# (directory) -> (config, global fp32 factors); `tessera serve` passes one that reads PEFT too.
AdapterReader = Callable[[Path], tuple[AdapterConfig, dict[str, torch.Tensor]]]
PEFT_CONFIG = "adapter_config.json"  # what marks a PEFT adapter directory
_NAME = re.compile(r"^[^:/\s]+$")


class UnknownAdapter(AdapterError):
    """No adapter of that name is loaded (the HTTP layer answers 404)."""


class AdapterBusy(AdapterError):
    """The adapter cannot be unloaded or loaded now (in use, name taken, no free slot): 409."""


@dataclass(frozen=True)
class LoRAServing:
    """How a server serves adapters.

    max_loras: adapters loaded at once (slots). max_rank: the largest module rank a slot holds
    (an imported PEFT adapter's fused qkv has rank 3 r when q, k and v were adapted).
    checkpoint: the served base, whose fingerprint adapters must carry. preload: (name, path)
    loaded at start, on every rank. allow_runtime: whether the HTTP routes may load and unload.
    reader: reads an adapter directory (default `read_tessera_adapter`, which refuses PEFT
    directories with a hint; `tessera serve` passes one that reads both).
    """

    max_loras: int = 4
    max_rank: int = 16
    checkpoint: str | None = None
    preload: tuple[tuple[str, str], ...] = ()
    allow_runtime: bool = False
    reader: AdapterReader | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"--max-loras ({self.max_loras}) and --max-lora-rank "
                             f"({self.max_rank}) must be at least 1")


def read_tessera_adapter(directory: Path, checkpoint: str | None
                         ) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A Tessera adapter directory (`tessera tune --method lora`), checked against the base."""
    if not (directory / CONFIG_FILE).is_file() and (directory / PEFT_CONFIG).is_file():
        raise AdapterError(f"{directory} is a PEFT adapter; `tessera serve` reads those (or "
                           "convert it: tessera convert --from peft)")
    config, tensors = load_adapter(directory)
    if checkpoint is not None:
        from tessera.core.fingerprint import base_fingerprint

        check_base(config, base_fingerprint(checkpoint), checkpoint)
    return config, tensors


@dataclass
class _Loaded:
    name: str
    path: str
    ident: str
    config: AdapterConfig
    users: weakref.WeakSet


class AdapterRegistry:
    """This rank's adapter slots over its model `stages` (see the module docstring)."""

    def __init__(self, stages: Sequence[nn.Module], serving: LoRAServing):
        self.serving = serving
        self.rows = AdapterRows()
        self._lock = threading.RLock()
        self._slots: list[_Loaded | None] = [None] * serving.max_loras
        self._hooks: dict[str, StackedLoRA] = {}
        self._model = stages[0]
        for model in stages:
            wanted = set(adaptable_modules(model.config))
            for name, layer in model.named_modules():
                if name in wanted and isinstance(layer, ParallelLinear):
                    hook = StackedLoRA(layer, serving.max_loras, serving.max_rank, self.rows)
                    layer.adapter = hook
                    self._hooks[name] = hook
        for name, path in serving.preload:
            self.load(name, path)

    # ----------------------------------------------------------------- queries

    def names(self) -> list[str]:
        with self._lock:
            return sorted(s.name for s in self._slots if s is not None)

    def path_of(self, name: str) -> str:
        with self._lock:
            return self._find(name).path

    def ident_of(self, name: str) -> str:
        with self._lock:
            return self._find(name).ident

    def acquire(self, name: str, user: object) -> tuple[int, str]:
        """(slot, ident) of adapter `name`, with `user` (an engine sequence, whose `finished`
        turns true when it is done) counted as using it. Raises `UnknownAdapter`."""
        with self._lock:
            loaded = self._find(name)
            loaded.users.add(user)
            return self._slots.index(loaded), loaded.ident

    # ----------------------------------------------------------------- load / unload

    def load(self, name: str, path: str | os.PathLike) -> str:
        """Load the adapter at `path` as `name` into a free slot; returns its ident.

        Raises `AdapterError` (bad name, unreadable or foreign adapter, a rank above
        `max_rank`) or `AdapterBusy` (the name is loaded, or every slot is taken)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise AdapterError(f"adapter name {name!r} is not allowed: give a non-empty name "
                               "without ':', '/' or spaces")
        directory = Path(path)
        if not directory.is_dir():
            raise AdapterError(f"no adapter directory at {directory}")
        reader = self.serving.reader
        config, tensors = (reader(directory) if reader is not None
                           else read_tessera_adapter(directory, self.serving.checkpoint))
        pieces = self._pieces(config, tensors, directory)
        ident = _ident(config, tensors)
        with self._lock:
            slot = self.check_room(name)
            for module, hook in self._hooks.items():
                a, b = pieces.get(module, (None, None))
                hook.put(slot, a, b, config.scaling)
            self._slots[slot] = _Loaded(name, str(directory), ident, config, weakref.WeakSet())
        return ident

    def check_room(self, name: str) -> int:
        """The free slot `name` would load into; `AdapterBusy` if the name is loaded or no
        slot is free."""
        with self._lock:
            if any(s is not None and s.name == name for s in self._slots):
                raise AdapterBusy(f"an adapter named {name!r} is already loaded; unload it "
                                  "first or choose another name")
            free = [i for i, s in enumerate(self._slots) if s is None]
            if not free:
                raise AdapterBusy(f"all {len(self._slots)} adapter slots are taken "
                                  f"({', '.join(self.names())}); unload one, or serve with a "
                                  "larger --max-loras")
            return free[0]

    def unload(self, name: str) -> None:
        """Free `name`'s slot. Raises `UnknownAdapter`, or `AdapterBusy` while requests that
        use it are unfinished."""
        with self._lock:
            loaded = self._find(name)
            busy = sum(1 for u in list(loaded.users) if not getattr(u, "finished", True))
            if busy:
                raise AdapterBusy(f"adapter {name!r} is in use by {busy} unfinished "
                                  "request(s); unload it once they are done")
            slot = self._slots.index(loaded)
            for hook in self._hooks.values():
                hook.put(slot, None, None, 0.0)
            self._slots[slot] = None

    # ----------------------------------------------------------------- helpers

    def _find(self, name: str) -> _Loaded:
        for s in self._slots:
            if s is not None and s.name == name:
                return s
        loaded = self.names()
        raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded; loaded: "
                             f"{loaded if loaded else 'none'}")

    def _pieces(self, config: AdapterConfig, tensors: dict[str, torch.Tensor], where: Path
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (A, B) pieces per module it holds, every module's rank checked."""
        model = self._model
        known = set(adaptable_modules(model.config))
        out = {}
        for module in config.modules:
            if module not in known:
                raise AdapterError(f"adapter {where} adapts {module}, which this model does not "
                                   f"have (its modules are layers.N.{{attention.wqkv, "
                                   "attention.wo, feed_forward.w1, feed_forward.w2}})")
            a_name, b_name = lora_names(module)
            a, b = tensors[a_name].float(), tensors[b_name].float()
            if a.shape[0] > self.serving.max_rank:
                raise AdapterError(
                    f"adapter {where}: {module} has rank {a.shape[0]}, above this server's "
                    f"--max-lora-rank {self.serving.max_rank} (an imported PEFT adapter's fused "
                    "qkv has rank 3 r when q, k and v were adapted); serve with "
                    f"--max-lora-rank {a.shape[0]} or more")
            if module in self._hooks:
                g = model.groups
                out[module] = (shard_tensor(a_name, a, model.config, g.tp_rank, g.tp_size),
                               shard_tensor(b_name, b, model.config, g.tp_rank, g.tp_size))
            elif model.groups.pp_size == 1:  # not another pipeline rank's: not adaptable here
                raise AdapterError(f"adapter {where} adapts {module}, which is not a linear "
                                   "layer of this model (e.g. an MoE layer's experts)")
        return out


def detach_stacked(stages: Sequence[nn.Module]) -> None:
    """Remove the serving hooks `AdapterRegistry` attached (a trained `core.lora` stays)."""
    for model in stages:
        for layer in model.modules():
            if isinstance(layer, ParallelLinear) and isinstance(layer.adapter, StackedLoRA):
                layer.adapter = None


def _ident(config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of what the adapter computes: its scale and its factors."""
    digest = hashlib.sha256(repr(float(config.scaling)).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()
