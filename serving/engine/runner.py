"""The model side of a step: input preparation, one rank's forward pass, prompt-tuned tasks.

`ModelRunner` is what every rank runs: its own pipeline stages and its own KV cache (local
layers, local kv heads). On the engine's rank it also turns the scheduler's output into model
inputs (`execute_model`): rows of one token (decodes, and speculative rows of a decode and its
drafts) and longer prefill chunks run as separate passes, each a `StepBatch` of token ids,
absolute positions, KV cache rows and task indices, and it returns the logits of the positions
each scheduled request needs (`RunnerOutput`). How a `StepBatch` reaches the other ranks is the
executor's business (`serving.engine.executor`).

Prompt-tuned tasks: a task is a table of virtual-token embeddings `(n_virtual, hidden)`. A
request of that task is prefixed by `n_virtual` placeholder ids, and the `core.prompts` hook,
installed on the first stage, replaces the embeddings at absolute positions `< n_virtual` of
that request's rows with the table's rows. Plain and tasked requests, and requests of different
tasks, share a batch.

LoRA adapters per request: with `lora=`, the runner's `serving.engine.adapters.AdapterRegistry`
hooks every adaptable linear layer, and each batch's `adapters` (a slot per row, -1 for none)
selects which adapter each row adds, as the task hook does for virtual tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tessera.core.config import ModelConfig
from tessera.core.kv_cache import KVCache
from tessera.core.models.decoder.model import GPTModel
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.pipeline_forward import pipeline_forward
from tessera.core.parallel.sharding import kv_geometry
from tessera.core.prompts import VirtualPrompts, attach_prompts, fixed_prompts
from tessera.serving.engine.adapters import AdapterRegistry, LoRAServing, detach_stacked
from tessera.serving.engine.compiled import CompiledDecode, bucket_for
from tessera.serving.engine.executor import StopServing
from tessera.serving.engine.kv_config import KVCacheConfig, resolve_num_blocks
from tessera.serving.engine.scheduler import StepPlan
from tessera.serving.engine.transfer import copy_into, to_device

if TYPE_CHECKING:
    from tessera.serving.engine.request import EngineRequest

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One forward pass of a step. Rows are requests; padding is at the end of short rows.

    Every tensor is long. `length` is the largest position + 1 when known on the host (the
    runner knows it; a batch received from another rank leaves it None and the cache reads it).
    """

    ids: torch.Tensor  # (B, T) long
    positions: torch.Tensor  # (B, T) long, absolute positions in each request's sequence
    slots: torch.Tensor  # (B,) long, KV cache slot of each row; (B, W) block tables if paged
    tasks: torch.Tensor  # (B,) long, task index (see `task_names`) or -1 for none
    keep: torch.Tensor  # (N,) long, flat indices into B * T whose logits are wanted
    # Per-request LoRA: (B,) long, each row's adapter slot (serving.engine.adapters), -1 for none;
    # None when no row of the batch uses an adapter.
    adapters: torch.Tensor | None = None
    length: int | None = None
    # A one-token pass padded to a batch bucket for the static-shape decode step
    # (`serving.engine.compiled`): rows (B, context width), adapters always set, `keep` padded
    # to B (the logits past the wanted ones are padding's).
    static: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.positions, self.slots, self.tasks, self.keep] + (
            [self.adapters] if self.adapters is not None else [])

    def to(self, device: torch.device | str, into: torch.Tensor | None = None) -> StepBatch:
        """The batch on `device` in one copy: its tensors packed into one, copied through pinned
        memory without waiting on a GPU (`serving.engine.transfer`), and split there. With
        `into` (a long tensor of the packed size on `device`), the copy goes there and the
        batch's tensors are views of it."""
        device = torch.device(device)
        parts = self.tensors()
        if into is None and all(t.device == device for t in parts):
            return self
        packed = torch.cat([t.reshape(-1) for t in parts])
        flat = to_device(packed, device) if into is None else copy_into(into, packed)
        moved = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in parts]), parts)]
        adapters = moved[5] if self.adapters is not None else None
        return StepBatch(*moved[:5], adapters, self.length, self.static)


def task_names(tasks: Mapping[str, torch.Tensor] | None) -> list[str]:
    """Task order (index = position), the same on every rank: sorted by name."""
    return sorted(tasks or {})


@dataclass
class PassOutput:
    """One forward pass's result: the rows it ran `(request, tokens)`, the positions wanted
    `(request, prompt position t, or None for the position to sample from)` with their logits
    `(len(wanted), vocab)` fp32, and each speculative row's logits `(1 + len(draft), vocab)`."""

    rows: list[tuple[EngineRequest, int]]
    wanted: list[tuple[EngineRequest, int | None]]
    logits: torch.Tensor
    drafts: list[tuple[EngineRequest, torch.Tensor]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    """A step's passes, and the requests whose pass failed (with the error's message)."""

    passes: list[PassOutput] = field(default_factory=list)
    failed: list[tuple[EngineRequest, str]] = field(default_factory=list)


RunPass = Callable[[StepBatch], torch.Tensor]  # runs a batch on every rank: kept logits


class ModelRunner:
    """One rank's share of every step: its model stages, its KV cache and the task hook.

    `kv` chooses the cache (`serving.engine.kv_config`); without it, wave 1's slot cache of
    `max_batch` slots. A paged cache's block count must be the same on every rank (give
    `kv.num_blocks`; `distributed.start_rank` agrees on one).

    `lora` serves per-request LoRA adapters (`serving.engine.adapters`): `adapters` is then this rank's
    registry, and each batch's `adapters` rows select them.

    `compile_decode` runs one-token passes through the static-shape decode step
    (`serving.engine.compiled`, with either cache, with adapters): True compiles its block with
    Inductor, a string names another `torch.compile` backend, "static" runs it uncompiled.
    """

    def __init__(self, stages: GPTModel | Sequence[GPTModel], max_batch: int,
                 tasks: Mapping[str, torch.Tensor] | None = None, max_seq: int | None = None,
                 compile_decode: bool | str = False, kv: KVCacheConfig | None = None,
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
        entry = kv_geometry(c, tp)  # what one token of one layer keeps
        if kv is not None and kv.kind == "paged":
            num_blocks = resolve_num_blocks(
                kv, num_layers=len(layer_ids), kv_heads=entry.heads, head_dim=entry.key_dim,
                dtype=self.dtype, device=self.device, max_batch=max_batch, max_seq=self.max_seq,
                value_dim=entry.value_dim)
            self.cache = PagedKVCache(layer_ids, num_blocks, kv.block_size, self.max_seq,
                                      entry.heads, entry.key_dim, self.dtype, self.device,
                                      decode_attention=kv.decode_attention,
                                      windows={c.layer_window(i) for i in layer_ids},
                                      value_dim=entry.value_dim)
        else:
            # A static decode step pads its batches with rows that write to one more slot.
            slots = max_batch + 1 if compile_decode else max_batch
            self.cache = KVCache(layer_ids, slots, self.max_seq, entry.heads, entry.key_dim,
                                 self.dtype, self.device, value_dim=entry.value_dim)
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
        self.adapters = AdapterRegistry(self.stages, lora) if lora is not None else None
        if lora is None:  # no hooks left over from another runner of this model
            detach_stacked(self.stages)
        self.decode: CompiledDecode | None = None
        if compile_decode:
            if len(self.stages) != 1:
                raise ValueError("a compiled decode step needs the whole model in one process")
            backend = {True: "inductor", "static": None}.get(compile_decode, compile_decode)
            self.decode = CompiledDecode(
                first, self.cache, max_batch, backend=backend,  # type: ignore[arg-type]
                adapter_rows=self.adapters.rows if self.adapters is not None else None)
            seconds = self.decode.warm_up()
            log.info("decode step compiled in %.1f s", seconds)

    @property
    def holds_last_stage(self) -> bool:
        return any(m.is_last for m in self.stages)

    def place(self, batch: StepBatch) -> StepBatch:
        """`batch` on this rank's device in one copy; a static pass lands in its bucket's
        input buffer (`CompiledDecode.inputs`)."""
        if not batch.static:
            return batch.to(self.device)
        assert self.decode is not None  # only the static decode step's batches are static
        x = self.decode.inputs[batch.ids.shape[0]]
        if batch.ids.data_ptr() == x.ids.data_ptr():
            return batch
        return batch.to(self.device, into=x.flat)

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits `(N, vocab)` fp32 of the kept positions where the last stage lives, else None
        (N: the batch's `keep`, padded to its bucket for a static pass)."""
        if batch.static:
            batch = self.place(batch)
        if self.hook is not None:
            self.hook.set_rows(batch.tasks)
        if batch.static:
            assert self.decode is not None
            out = self.decode(self.decode.inputs[batch.ids.shape[0]])
            return out.reshape(-1, out.shape[-1])[batch.keep].float()
        if self.adapters is not None:
            self.adapters.rows.set(batch.adapters)
        kwargs = dict(positions=batch.positions, cache=self.cache, slots=batch.slots,
                      kv_length=batch.length)
        if len(self.stages) == 1 and self.groups.pp_size == 1:
            out = self.stages[0](batch.ids, **kwargs)
        else:
            out = pipeline_forward(self.stages, self.groups, batch.ids, **kwargs)
        if out is None:
            return None
        return out.reshape(-1, out.shape[-1])[batch.keep].float()

    def execute_model(self, plan: StepPlan, pad_id: int, run: RunPass) -> RunnerOutput:
        """The logits each scheduled request of `plan` needs, pass by pass; `run` runs a batch
        on every rank (`Executor.run`). Padding ids are `pad_id`.

        Decodes and prefill chunks run as separate passes, so neither pads to the other's
        length; speculative rows join the decodes (padding a decode to 1 + k tokens costs less
        than a second pass over the weights). Rows go in slot order: with the lowest free slot
        taken first, running slots are usually consecutive and the eager KV cache reads them
        as a view instead of gathering a copy. A pass that raises fails only its rows
        (`RunnerOutput.failed`); `StopServing` propagates."""
        decodes = [r for r in plan.rows if r[1] == 1 or r[0].draft]
        prefills = [r for r in plan.rows if r[1] > 1 and not r[0].draft]
        out = RunnerOutput()
        for group in (decodes, prefills):
            group.sort(key=lambda row: row[0].slot)
            if not group:
                continue
            batch, wanted, drafted = self.prepare_inputs(group, plan.kv_rows, pad_id)
            try:
                logits = run(batch)
            except StopServing:
                raise
            except Exception as exc:
                log.exception("forward pass failed")
                out.failed.extend((seq, str(exc)) for seq, _ in group)
                continue
            n_wanted = len(wanted)
            drafts, at = [], n_wanted
            for seq, _ in drafted:
                drafts.append((seq, logits[at:at + len(seq.draft) + 1]))
                at += len(seq.draft) + 1
            out.passes.append(PassOutput(group, wanted, logits[:n_wanted], drafts))
        return out

    def prepare_inputs(
        self, group: list[tuple[EngineRequest, int]],
        kv_rows: Callable[[list[EngineRequest], int], torch.Tensor], pad_id: int,
    ) -> tuple[StepBatch, list[tuple[EngineRequest, int | None]], list[tuple[EngineRequest, int]]]:
        """One pass's `StepBatch` for `group` `(request, tokens to run)`, the positions whose
        logits come first in its output `(request, prompt position or None)`, and its
        speculative rows `(request, row)`, whose every position's logits follow in order."""
        B, T = len(group), max(n for _, n in group)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        # Positions are worked out in Python: the pass's length is then known without reading
        # a tensor. Padding continues the positions (clipped to the cache): it writes keys
        # nobody attends to, past the row's real tokens, which later tokens overwrite.
        last = self.max_seq - 1
        position_rows = [[min(seq.cached + j, last) for j in range(T)] for seq, _ in group]
        length = max(row[-1] for row in position_rows) + 1
        keep: list[int] = []
        wanted: list[tuple[EngineRequest, int | None]] = []
        drafted: list[tuple[EngineRequest, int]] = []
        for r, (seq, n) in enumerate(group):
            start = seq.cached
            if seq.draft:  # the last token, then the drafts (n = 1 + len(draft))
                ids[r, :n] = torch.tensor(seq.tokens[start:] + seq.draft)
                drafted.append((seq, r))
                continue
            ids[r, :n] = torch.tensor(seq.tokens[start:start + n])
            if seq.prompt_logprobs is not None:
                for t in range(max(start, seq.n_virtual), min(start + n, seq.n_input - 1)):
                    keep.append(r * T + t - start)
                    wanted.append((seq, t))
            if start + n == len(seq.tokens):
                keep.append(r * T + n - 1)
                wanted.append((seq, None))
        for seq, r in drafted:
            keep.extend(r * T + j for j in range(len(seq.draft) + 1))
        if self.decode is not None and T == 1:
            return self._static_inputs(group, kv_rows, pad_id, ids, position_rows, keep), \
                wanted, drafted
        rows = kv_rows([s for s, _ in group], length)
        adapters = None
        if any(s.adapter >= 0 for s, _ in group):
            adapters = torch.tensor([s.adapter for s, _ in group], dtype=torch.long)
        batch = StepBatch(ids, torch.tensor(position_rows, dtype=torch.long), rows,
                          torch.tensor([s.task for s, _ in group], dtype=torch.long),
                          torch.tensor(keep, dtype=torch.long), adapters, length)
        return batch, wanted, drafted

    def _static_inputs(self, group: list[tuple[EngineRequest, int]],
                       kv_rows: Callable[[list[EngineRequest], int], torch.Tensor], pad_id: int,
                       ids: torch.Tensor, position_rows: list[list[int]], keep: list[int]
                       ) -> StepBatch:
        """A one-token pass padded to its batch bucket, reading each row's whole context (see
        `StepBatch.static`): padding rows write to the scratch row at position 0."""
        assert self.decode is not None
        B = len(group)
        b = bucket_for(self.decode.buckets, B)
        pad = b - B
        rows = kv_rows([s for s, _ in group], self.max_seq)
        rows = torch.cat([rows, torch.full((pad, *rows.shape[1:]), self.decode.scratch,
                                           dtype=torch.long)])
        return StepBatch(
            torch.cat([ids, torch.full((pad, 1), pad_id, dtype=torch.long)]),
            torch.tensor([p for p, in position_rows] + [0] * pad, dtype=torch.long).view(b, 1),
            rows, torch.tensor([s.task for s, _ in group] + [-1] * pad, dtype=torch.long),
            torch.tensor(keep + [0] * (b - len(keep)), dtype=torch.long),
            torch.tensor([s.adapter for s, _ in group] + [-1] * pad, dtype=torch.long),
            self.max_seq, static=True)
