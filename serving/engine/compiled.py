"""A decode step compiled by TorchInductor, for single-process serving.

Why: a decode step of a small model is mostly per-operator overhead, not arithmetic. On the
2-core CPU, an eager step of the benchmark model (hidden 512, 8 layers) takes 5.7 ms while its
matrix products alone take 2.2 ms. Compiled as one graph, with the weights frozen (inductor
constant-folds them and prepacks them for oneDNN, which is what makes bf16 products fast on
CPU), the step takes 2.8 ms in bf16. See the README's benchmark table for the engine figures.

Contract:
- Only one-token passes (decodes, and a prefill chunk of one token) run compiled; longer
  prefill chunks run eagerly, where the products are large and overhead small. Logits match
  the eager model's to rounding.
- The embedding (and a prompt-tuning hook on it) and the KV cache's pass plan run eagerly; the
  compiled graph is `GPTModel.forward_hidden`, which reads no tensor values on the host.
- Shapes are dynamic (batch size and cached length), so two graphs cover every step: one row,
  and several rows. Both read the cache by gathering their slots' prefixes rather than through
  a view of consecutive slots, so neither depends on which slots a step uses. The two lengths
  dynamo would specialize (1, and the whole cache) run eagerly. `warm_up` compiles both graphs
  before the first request, so no request waits on the compiler (a test checks that serving,
  up to the context's last position, compiles nothing more).
- Weights are frozen: the model must not change afterwards, and inductor keeps a prepacked
  copy of each matrix next to the original (the eager prefill still uses the original), so
  weight memory doubles.
- One process only: tensor- and pipeline-parallel layouts run eagerly (their collectives would
  split the graph). Not with int8 weights (`core.quantize`) yet.
- Not Mixture-of-Experts models (refused): the dispatch's data-dependent shapes split the graph
  (against the two-graph contract above), and `torch._grouped_mm` has no fp32 fake-tensor
  kernel to trace on CPU (torch 2.13).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from tessera.core.compile_cache import key_compile_cache_by_isa
from tessera.core.kv_cache import KVCache
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.quantize import Int8

log = logging.getLogger(__name__)


class CompiledDecode:
    """Runs one-token passes of `model` (a whole single-process model, in eval mode) compiled.

    Build it, then `warm_up(cache)` once with the KV cache every later call will use.
    """

    def __init__(self, model: GPTModel):
        if not (model.is_first and model.is_last) or model.groups.tp_size != 1:
            raise ValueError("a compiled decode step needs the whole model in one process "
                             "(tp=1, pp=1); serve tensor/pipeline-parallel layouts without it")
        if model.config.moe.num_experts:
            raise ValueError(
                "a compiled decode step does not run Mixture-of-Experts models (num_experts "
                f"{model.config.moe.num_experts}): their token dispatch has data-dependent shapes "
                "(torch.nonzero, tokens per expert) that split the graph, and the compiler "
                "cannot trace torch._grouped_mm in fp32 on CPU; serve without --compile "
                "(compile_decode=False), the eager engine runs them")
        if model.training:
            raise ValueError("a compiled decode step freezes the weights: call model.eval() "
                             "first (dropout would be compiled in)")
        if any(isinstance(m, ParallelLinear) and isinstance(m.format, Int8)
               for m in model.modules()):
            raise ValueError("int8 weights and a compiled decode step do not combine yet (the "
                             "int8 kernel's row limit would need a graph of its own): use "
                             "--quantize int8 or --compile, not both")
        device = next(model.parameters()).device
        # Read from the global config while a graph compiles, so `warm_up` patches them in (an
        # `options` entry for freezing is silently ignored). cpp_wrapper: the graph's calling
        # code is C++ rather than Python, a further ~10% of a CPU decode step; on CUDA it would
        # build against the CUDA toolchain, so it is left off there.
        self._config = {"freezing": True, "cpp_wrapper": device.type == "cpu"}
        self.model = model
        self._cache: KVCache | None = None
        key_compile_cache_by_isa()
        self._forward_hidden = torch.compile(model.forward_hidden, dynamic=True)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 slots: torch.Tensor) -> torch.Tensor:
        """Logits `(B, 1, vocab)` for the tokens `ids (B, 1)` at `positions (B, 1)`."""
        if ids.shape[1] != 1:
            raise ValueError(f"a compiled decode pass takes one token per row, got {ids.shape[1]}")
        if cache is not self._cache:
            raise ValueError("a compiled decode step runs with the KV cache it was warmed up "
                             "with (CompiledDecode.warm_up)")
        # The graph is guarded on its inputs' autograd keys, which differ between tensors made
        # under inference_mode and the rest: copies made here are always inference tensors, so
        # callers of either kind reuse the warm-up's graphs instead of compiling new ones.
        positions, slots = positions.clone(), slots.clone()
        h = self.model.embed(ids, positions).transpose(0, 1).contiguous()
        cache.begin(positions, slots, views=False)
        if cache.pass_length in (1, cache.max_seq):
            # A cached length of 1 (a one-token prompt) or of the whole cache (the context's
            # last position) would each be compiled into a graph of its own (dynamo makes the
            # first a constant and the second a full slice). Once per request: run it eagerly.
            return self.model.forward_hidden(h, positions=positions, cache=cache, slots=slots)
        return self._forward_hidden(h, positions=positions, cache=cache, slots=slots)

    def _compile_settings(self) -> contextlib.ExitStack:
        """What the compiles in `warm_up` must see.

        No duck shaping: by default two dimensions that happen to be equal while compiling
        (say 2 rows and 2 kv heads) are assumed equal forever, and the graph is recompiled when
        they differ; every variable dimension gets its own symbol instead. A higher recompile
        limit: dynamo counts graphs per function, and every model's `forward_hidden` shares one,
        so the fifth engine in a process would otherwise silently stay eager.

        These settings are process-wide while they last; compile from one thread at a time.
        """
        stack = contextlib.ExitStack()
        stack.enter_context(torch._inductor.config.patch(self._config))
        stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))
        limit = max(torch._dynamo.config.recompile_limit, 64)
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
        return stack

    def warm_up(self, cache: KVCache) -> float:
        """Compile every graph serving needs, for `cache`; returns the seconds it took.

        Writes keys and values at position 1 of slots 0 and 1, which are free before any
        request arrives: a request's prefill rewrites every position it later reads. (Position
        1, not 0: a cached length of 1 would be compiled as a constant, not as a variable.)
        Raises RuntimeError if torch compiled something other than the graphs it expects.
        """
        if cache.max_seq < 3:
            raise ValueError(f"a compiled decode step needs a cache of 3 positions or more, "
                             f"not {cache.max_seq}")
        # The cache's shape never changes: without this, `dynamic=True` would make its slot,
        # head and length dimensions variables too.
        for t in (*cache.keys.values(), *cache.values.values()):
            torch._dynamo.mark_static(t)
        self._cache = cache
        tic = time.perf_counter()
        cases = [[0]] if cache.num_slots == 1 else [[0], [1, 0]]
        device = next(iter(cache.keys.values())).device
        before = _graphs_compiled()
        with self._compile_settings():
            for slots in cases:
                n = len(slots)
                log.info("compiling the decode step for %s", "one row" if n == 1 else "many rows")
                self(torch.zeros((n, 1), dtype=torch.long, device=device),
                     torch.ones((n, 1), dtype=torch.long, device=device), cache,
                     torch.tensor(slots, device=device))
        compiled = _graphs_compiled() - before
        if compiled != len(cases):
            raise RuntimeError(f"compiling the decode step gave {compiled} graphs where "
                               f"{len(cases)} were expected; serve without compiling")
        return time.perf_counter() - tic


def _graphs_compiled() -> int:
    """Graphs dynamo has captured in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
