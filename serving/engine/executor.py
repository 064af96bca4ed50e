"""The model side of the engine: one step's batch, one rank's forward pass, prompt-tuned tasks.

The engine (rank 0) decides each step as a `StepBatch` of token ids, absolute positions, KV
cache slots and task indices, and asks an executor for the logits of chosen positions. The
`ModelRunner` is what every rank runs: its own pipeline stages and its own KV cache (local
layers, local kv heads). `LocalExecutor` runs it in this process; `serving.engine.distributed` runs it
on every rank of a tensor/pipeline-parallel layout with rank 0 broadcasting the batch.

Prompt-tuned tasks: a task is a table of virtual-token embeddings `(n_virtual, hidden)`. A
request of that task is prefixed by `n_virtual` placeholder ids, and tuning's `VirtualPrompts`
hook (the one prompt tuning trains through, so served and tuned prompts behave alike), installed
on the first stage, replaces the embeddings at absolute positions `< n_virtual` of that
request's rows with the table's rows. Plain and tasked requests, and requests of different
tasks, share a batch.

LoRA adapters per request: with `lora=`, the runner's `serving.engine.adapters.AdapterRegistry` hooks
every adaptable linear layer, and each batch's `adapters` (a slot per row, -1 for none) selects
which adapter each row adds, as the task hook does for virtual tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.core.config import ModelConfig
from tessera.core.kv_cache import KVCache
from tessera.core.model import GPTModel
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.pipeline_forward import pipeline_forward
from tessera.core.parallel.sharding import local_kv_heads
from tessera.core.prompts import VirtualPrompts, attach_prompts, fixed_prompts
from tessera.serving.engine.adapters import AdapterRegistry, LoRAServing, detach_stacked
from tessera.serving.engine.compiled import CompiledDecode
from tessera.serving.engine.kv_config import KVCacheConfig, resolve_num_blocks

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One forward pass of a step. Rows are requests; padding is at the end of short rows."""

    ids: torch.Tensor  # (B, T) long
    positions: torch.Tensor  # (B, T) long, absolute positions in each request's sequence
    slots: torch.Tensor  # (B,) long, KV cache slot of each row; (B, W) block tables if paged
    tasks: torch.Tensor  # (B,) long, task index (see `task_names`) or -1 for none
    keep: torch.Tensor  # (N,) long, flat indices into B * T whose logits are wanted
    # Per-request LoRA: (B,) long, each row's adapter slot (serving.engine.adapters), -1 for none;
    # None when no row of the batch uses an adapter.
    adapters: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> StepBatch:
        adapters = self.adapters.to(device) if self.adapters is not None else None
        return StepBatch(*(t.to(device) for t in (self.ids, self.positions, self.slots,
                                                   self.tasks, self.keep)), adapters)


def task_names(tasks: Mapping[str, torch.Tensor] | None) -> list[str]:
    """Task order (index = position), the same on every rank: sorted by name."""
    return sorted(tasks or {})


class ModelRunner:
    """One rank's share of every step: its model stages, its KV cache and the task hook.

    `kv` chooses the cache (`serving.engine.kv_config`); without it, wave 1's slot cache of
    `max_batch` slots. A paged cache's block count must be the same on every rank (give
    `kv.num_blocks`; `distributed.start_rank` agrees on one).

    `lora` serves per-request LoRA adapters (`serving.engine.adapters`): `adapters` is then this rank's
    registry, and each batch's `adapters` rows select them.
    """

    def __init__(self, stages: GPTModel | Sequence[GPTModel], max_batch: int,
                 tasks: Mapping[str, torch.Tensor] | None = None, max_seq: int | None = None,
                 compile_decode: bool = False, kv: KVCacheConfig | None = None,
                 lora: LoRAServing | None = None):
        self.stages = [stages] if isinstance(stages, GPTModel) else list(stages)
        first = self.stages[0]
        self.config: ModelConfig = first.config
        self.groups: ParallelGroups = first.groups
        param = next(first.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_batch = max_batch
        self.max_seq = max_seq or self.config.max_position_embeddings
        c, tp = self.config, self.groups.tp_size
        layer_ids = [i for m in self.stages for i in m.layer_ids]
        self.cache: KVCache | PagedKVCache
        if kv is not None and kv.kind == "paged":
            if compile_decode:
                raise ValueError("the compiled decode step reads the slot cache: serve with "
                                 "--kv-cache slots to compile, or without --compile")
            num_blocks = resolve_num_blocks(
                kv, num_layers=len(layer_ids), kv_heads=local_kv_heads(c, tp),
                head_dim=c.head_dim, dtype=self.dtype, device=self.device, max_batch=max_batch,
                max_seq=self.max_seq)
            self.cache = PagedKVCache(layer_ids, num_blocks, kv.block_size, self.max_seq,
                                      local_kv_heads(c, tp), c.head_dim, self.dtype, self.device)
        else:
            self.cache = KVCache(layer_ids, max_batch, self.max_seq, local_kv_heads(c, tp),
                                 c.head_dim, self.dtype, self.device)
        self.tasks = {n: int(tasks[n].shape[0]) for n in task_names(tasks)}
        self.hook: VirtualPrompts | None = None
        for m in self.stages:
            m.eval()
            if m.is_first:  # this runner owns the model: no hook left over from another user
                m.embedding_hook = None
        if tasks and first.is_first:
            for name in self.tasks:
                if tasks[name].ndim != 2 or tasks[name].shape[1] != c.hidden_size:
                    raise ValueError(f"task {name!r}: virtual-token table has shape "
                                     f"{tuple(tasks[name].shape)}, expected (n_virtual, "
                                     f"{c.hidden_size})")
            # Task index = position in `task_names` order, as the engine numbers them.
            self.hook = attach_prompts(first, fixed_prompts({n: tasks[n] for n in self.tasks}))
        # Per-request LoRA: every adaptable layer gets a slot-stacked hook (serving.engine.adapters).
        if lora is not None and compile_decode:
            raise ValueError("LoRA adapters are served eagerly: drop --compile, or --lora")
        self.adapters = AdapterRegistry(self.stages, lora) if lora is not None else None
        if lora is None:  # no hooks left over from another runner of this model
            detach_stacked(self.stages)
        self.decode: CompiledDecode | None = None
        if compile_decode:
            if len(self.stages) != 1:
                raise ValueError("a compiled decode step needs the whole model in one process")
            self.decode = CompiledDecode(first)
            seconds = self.decode.warm_up(self.cache)
            log.info("decode step compiled in %.1f s", seconds)

    @property
    def holds_last_stage(self) -> bool:
        return any(m.is_last for m in self.stages)

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits `(N, vocab)` fp32 of the kept positions where the last stage lives, else None."""
        if self.hook is not None:
            self.hook.set_rows(batch.tasks)
        if self.adapters is not None:
            self.adapters.rows.set(batch.adapters)
        kwargs = dict(positions=batch.positions, cache=self.cache, slots=batch.slots)
        if self.decode is not None and batch.ids.shape[1] == 1:
            out = self.decode(batch.ids, batch.positions, self.cache, batch.slots)
        elif len(self.stages) == 1 and self.groups.pp_size == 1:
            out = self.stages[0](batch.ids, **kwargs)
        else:
            out = pipeline_forward(self.stages, self.groups, batch.ids, **kwargs)
        if out is None:
            return None
        return out.reshape(-1, out.shape[-1])[batch.keep].float()


class StopServing(RuntimeError):
    """The serving job is stopping: a rank asked to, or the ranks can no longer talk."""


class Executor(Protocol):
    """What the engine needs to run a step (`LocalExecutor`, `distributed.DistributedExecutor`)."""

    runner: ModelRunner  # this process's share (rank 0 always holds the first stage)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits `(N, vocab)` fp32 of the kept positions, on `runner.device`.

        Raises `StopServing` when the job must stop; any other exception fails this batch only.
        """
        ...

    def heartbeat(self) -> bool:
        """Called about once a second while idle; False means some rank asked to stop."""
        ...

    def close(self) -> None:
        """Release the other ranks (they return from their worker loop)."""
        ...


class LocalExecutor:
    """Runs every step in this process (no tensor or pipeline parallelism)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def run(self, batch: StepBatch) -> torch.Tensor:
        out = self.runner.forward(batch.to(self.runner.device))
        assert out is not None  # a single process holds the last stage
        return out

    def heartbeat(self) -> bool:
        return True

    def close(self) -> None:
        pass
