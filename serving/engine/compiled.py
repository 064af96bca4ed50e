"""The decode step with static shapes: batch buckets, static input buffers, one graph per bucket.

Why: a decode step of a small model is mostly per-operator overhead (Python, kernel launches),
and shapes that change every step (batch size, cached length) make a compiler recompile and a
GPU library re-plan. Here every one-token pass has one of a few shapes, fixed at start-up:

- Batch buckets: a pass of B rows is padded to the smallest bucket >= B of `batch_buckets`
  (1, 2, 4, ..., then `max_batch`). Padding rows write their keys to a scratch row nobody
  reads (the paged cache's scratch block, the slot cache's extra slot) and their logits are
  dropped.
- KV length: every pass reads each row's whole context (`max_seq` positions: its slot, or its
  block table padded to the context's width with the scratch block), masked to each row's own
  positions, so one graph per bucket serves every cached length.
- Static inputs: each bucket has one flat device buffer (ids, positions, rows, tasks, kept
  positions, adapters); a step fills it with one copy from pinned host memory, without
  waiting (`ModelRunner.place`).

What runs compiled: one transformer block (regional compilation, `core.regional_compile`),
shared by every layer: each layer is handed its own keys and values (`core.kv_cache.LayerKV`),
so no graph depends on a layer's number. The embedding (and a prompt-tuning hook) and the head
run eagerly. On CUDA the whole step after the embedding is captured once per bucket as a
`torch.cuda.CUDAGraph` at start-up and replayed. On a CPU there are no graphs: the same
bucketed, static-shape code runs, with the block compiled by Inductor (or any `torch.compile`
backend, `backend=None` for none).

Per-request LoRA adapters: every row gathers its own adapter's factors
(`core.lora_batched.AdapterRows.set_per_row`), which needs no host read and no shape that
depends on the mix of adapters.

Contract: logits match the eager model's to rounding; after `warm_up`, serving compiles
nothing more (any batch size up to `max_batch`, any cached length up to the context). One
process only (tp = pp = 1); not Mixture-of-Experts models, not int8 weights.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.core.attention_backends import cached_attention_backends
from tessera.core.compile_cache import key_compile_cache_by_isa
from tessera.core.kv_cache import KVCache, LayerKV
from tessera.core.lora_batched import AdapterRows
from tessera.core.models.decoder.model import GPTModel
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.quantize import Int8
from tessera.serving.engine.block_manager import SCRATCH_BLOCK

log = logging.getLogger(__name__)

def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes: powers of two below `max_batch`, then `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


def bucket_for(buckets: list[int], rows: int) -> int:
    """The smallest bucket holding `rows` rows."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"a decode pass of {rows} rows exceeds the largest bucket {buckets[-1]}")


@dataclass
class StaticInputs:
    """One bucket's flat input buffer on the device (long) and its views, in
    `runner.StepBatch.tensors()` order, so a packed batch copies straight in."""

    flat: torch.Tensor
    ids: torch.Tensor  # (b, 1)
    positions: torch.Tensor  # (b, 1)
    rows: torch.Tensor  # (b,) slots or (b, width) block tables
    tasks: torch.Tensor  # (b,)
    keep: torch.Tensor  # (b,)
    adapters: torch.Tensor  # (b,)

    @classmethod
    def allocate(cls, bucket: int, width: int, device: torch.device) -> StaticInputs:
        sizes = [bucket, bucket, bucket * width, bucket, bucket, bucket]
        flat = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        ids, positions, rows, tasks, keep, adapters = flat.split(sizes)
        rows = rows.view(bucket, width) if width > 1 else rows
        return cls(flat, ids.view(bucket, 1), positions.view(bucket, 1), rows, tasks, keep,
                   adapters)


def _run_block(block: torch.nn.Module, h: torch.Tensor, rope: tuple[torch.Tensor, ...] | None,
               kv: LayerKV, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Contiguous out, as the embedding's output is (the next layer's input).
    return block(h, rope, kv, positions, rows).contiguous()


class CompiledDecode:
    """One-token passes of `model` (a whole single-process model, in eval mode) with static
    shapes over `cache` (module docstring).

    `backend`: the `torch.compile` backend of the block ("inductor"; "eager" traces without
    generating code, for tests), or None to run the bucketed code uncompiled. `adapter_rows`:
    the model's LoRA row selector when it serves adapters. Call `warm_up()` once before serving.
    """

    def __init__(self, model: GPTModel, cache: KVCache | PagedKVCache, max_batch: int,
                 backend: str | None = "inductor", adapter_rows: AdapterRows | None = None):
        if not (model.is_first and model.is_last) or model.groups.tp_size != 1:
            raise ValueError("a compiled decode step needs the whole model in one process "
                             "(tp=1, pp=1); serve tensor/pipeline-parallel layouts without it")
        if model.config.moe.num_experts:
            raise ValueError(
                "a compiled decode step does not run Mixture-of-Experts models (num_experts "
                f"{model.config.moe.num_experts}): their token dispatch has data-dependent "
                "shapes (torch.nonzero, tokens per expert) that a static-shape step cannot "
                "hold; serve without --compile (compile_decode=False)")
        if model.training:
            raise ValueError("a compiled decode step runs the model as it is: call "
                             "model.eval() first (dropout would be compiled in)")
        if any(isinstance(m, ParallelLinear) and isinstance(m.format, Int8)
               for m in model.modules()):
            raise ValueError("int8 weights and a compiled decode step do not combine yet (the "
                             "int8 kernel's row limit would need a graph of its own): use "
                             "--quantize int8 or --compile, not both")
        if cache.max_seq < 2:
            raise ValueError(f"a compiled decode step needs a cache of 2 positions or more, "
                             f"not {cache.max_seq}")
        self.model, self.cache, self.adapter_rows = model, cache, adapter_rows
        self.device = next(model.parameters()).device
        self.buckets = batch_buckets(max_batch)
        if isinstance(cache, PagedKVCache):
            self.width = -(-cache.max_seq // cache.block_size)  # the context's block table
            self.scratch = SCRATCH_BLOCK
        else:
            if cache.num_slots < max_batch + 1:
                raise ValueError(f"a compiled decode step over a slot cache needs a scratch "
                                 f"slot for padding rows: {max_batch + 1} slots, not "
                                 f"{cache.num_slots}")
            self.width, self.scratch = 1, max_batch
        self.inputs = {b: StaticInputs.allocate(b, self.width, self.device)
                       for b in self.buckets}
        self._layers = [(layer, cache.layer(int(i))) for i, layer in model.layers.items()]
        self._block = _run_block
        if backend is not None:
            key_compile_cache_by_isa()
            self._block = torch.compile(_run_block, backend=backend, dynamic=False)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def _after_embedding(self, h: torch.Tensor, x: StaticInputs) -> torch.Tensor:
        """Logits `(b, 1, vocab)` from the embedded tokens `h (1, b, C)` (all device work)."""
        model, cache = self.model, self.cache
        cache.begin(x.positions, x.rows, views=False, length=cache.max_seq)
        if self.adapter_rows is not None:
            self.adapter_rows.set_per_row(x.adapters)
        rope = (model.rotary.cos_sin(x.positions, h.dtype) if model.rotary is not None
                else None)
        with cached_attention_backends():
            for layer, kv in self._layers:
                # Strides as the embedding's: a size-1 dimension's stride is arbitrary in a
                # contiguous tensor, and the graphs are guarded on strides.
                h = self._block(layer, h.view(-1).view(h.shape), rope, kv, x.positions, x.rows)
        h = model.norm(h)
        weight = model.tok_embeddings.weight if model.output is None else model.output.weight
        logits = model.soft_capped(F.linear(h, weight))  # Gemma's final soft cap, if any
        return logits.transpose(0, 1)[..., :model.config.vocab_size]

    def __call__(self, x: StaticInputs) -> torch.Tensor:
        """Logits `(b, 1, vocab)` of the pass in `x` (one of `self.inputs`, filled)."""
        # Inference mode in every call, as at warm-up: graphs are guarded on their inputs'
        # autograd keys, and every tensor made here (the embedding, the rotary tables) is then
        # an inference tensor whoever calls. The buffers and the cache are the same tensors
        # each call, writable in inference mode whatever mode made them.
        with torch.inference_mode():
            h = self.model.embed(x.ids, x.positions).transpose(0, 1).contiguous()
            graph = self._graphs.get(x.ids.shape[0])
            if graph is None:
                return self._after_embedding(h, x)
            replay, h_in, logits = graph
            h_in.copy_(h)
            if self.adapter_rows is not None:
                self.adapter_rows.set_per_row(x.adapters)
            replay.replay()
            return logits

    def _compile_settings(self) -> contextlib.ExitStack:
        """A recompile limit that holds a graph per bucket for several models in one process
        (dynamo counts graphs per function, and every model shares `_run_block`)."""
        stack = contextlib.ExitStack()
        limit = max(torch._dynamo.config.recompile_limit, 16 * len(self.buckets))
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
        return stack

    def warm_up(self) -> float:
        """Compile each bucket's graph (and capture it, on CUDA); returns the seconds it took.

        Runs every bucket with padding rows only: they write the scratch row, which no
        request reads.
        """
        tic = time.perf_counter()
        with self._compile_settings():
            for b in self.buckets:
                log.info("compiling the decode step for %d rows", b)
                x = self.inputs[b]
                self.fill_padding(x)
                self(x)
                if self.device.type == "cuda":
                    self._capture(b, x)
        return time.perf_counter() - tic

    def fill_padding(self, x: StaticInputs) -> None:
        """Fill `x` with padding rows (scratch row, position 0, no task, no adapter)."""
        x.flat.zero_()
        x.rows.fill_(self.scratch)
        x.tasks.fill_(-1)
        x.adapters.fill_(-1)

    def _capture(self, bucket: int, x: StaticInputs) -> None:
        """Record the step after the embedding for `bucket` as a CUDA graph."""
        with torch.inference_mode():
            h = self.model.embed(x.ids, x.positions).transpose(0, 1).contiguous()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm the allocator off the capture
                self._after_embedding(h, x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._after_embedding(h, x)
        self._graphs[bucket] = (graph, h, logits)


def graphs_compiled() -> int:
    """Graphs dynamo has captured in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
