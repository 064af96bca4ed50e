"""A decode step compiled by TorchInductor, for single-process serving.

Why: a decode step of a small model is mostly per-operator overhead, not arithmetic. On the
2-core CPU, an eager step of the benchmark model (hidden 512, 8 layers) takes 5.7 ms while its
matrix products alone take 2.2 ms. Compiled as one graph, with the weights frozen (inductor
constant-folds them and prepacks them for oneDNN, which is what makes bf16 products fast on
CPU), the step takes 2.8 ms in bf16. See the README's benchmark table for the engine figures.

Contract:
- Only decode passes (one new token per row) run compiled; prefill chunks run eagerly, where
  the products are large and overhead small. Logits match the eager model's to rounding.
- The embedding (and a prompt-tuning hook on it) and the KV cache's pass plan run eagerly; the
  compiled graph is `GPTModel.forward_hidden`, which reads no tensor values on the host.
- Shapes are dynamic (batch size and cached length), so two graphs cover every step: one row,
  and several rows. Both read the cache by gathering their slots' prefixes rather than through
  a view of consecutive slots, so neither depends on which slots a step uses. `warm_up`
  compiles them before the first request, so no request waits on the compiler (a test checks
  that serving compiles nothing more).
- Weights are frozen: the model must not change afterwards, and inductor keeps a prepacked
  copy of each matrix next to the original (the eager prefill still uses the original), so
  weight memory doubles.
- One process only: tensor- and pipeline-parallel layouts run eagerly (their collectives would
  split the graph).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from tessera.core.kv_cache import KVCache
from tessera.core.model import GPTModel

log = logging.getLogger(__name__)


class CompiledDecode:
    """Runs decode passes of `model` (a whole single-process model, in eval mode) compiled."""

    def __init__(self, model: GPTModel):
        if not (model.is_first and model.is_last) or model.groups.tp_size != 1:
            raise ValueError("a compiled decode step needs the whole model in one process "
                             "(tp=1, pp=1); serve tensor/pipeline-parallel layouts without it")
        device = next(model.parameters()).device
        # cpp_wrapper: the graph's calling code is C++ rather than Python, a further ~10% of a
        # CPU decode step. On CUDA it would compile against the CUDA toolchain; left off there.
        # Freezing is read from the global config when a graph compiles (an `options` entry is
        # ignored), so it is patched in around each call, where (re)compiles happen.
        self._config = {"freezing": True, "cpp_wrapper": device.type == "cpu"}
        self.model = model
        self._static_cache: KVCache | None = None
        self._forward_hidden = torch.compile(model.forward_hidden, dynamic=True)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 slots: torch.Tensor) -> torch.Tensor:
        """Logits `(B, 1, vocab)` for the tokens `ids (B, 1)` at `positions (B, 1)`."""
        if ids.shape[1] != 1:
            raise ValueError(f"a compiled decode pass takes one token per row, got {ids.shape[1]}")
        # The graph is guarded on its inputs' autograd keys, which differ between tensors made
        # under inference_mode and the rest: copies made here are always inference tensors, so
        # callers of either kind reuse the warm-up's graphs instead of compiling new ones.
        positions, slots = positions.clone(), slots.clone()
        h = self.model.embed(ids, positions).transpose(0, 1).contiguous()
        cache.begin(positions, slots, views=False)
        if cache.pass_length == 1:
            # A one-token prompt: a length of 1 would be compiled as a constant; this pass is
            # as cheap eagerly.
            return self.model.forward_hidden(h, positions=positions, cache=cache, slots=slots)
        if self._static_cache is not cache:
            # The cache's shape never changes: without this, `dynamic=True` would make its
            # slot, head and length dimensions variables too.
            for t in (*cache.keys.values(), *cache.values.values()):
                torch._dynamo.mark_static(t)
            self._static_cache = cache
        with self._compile_settings():
            return self._forward_hidden(h, positions=positions, cache=cache, slots=slots)

    def _compile_settings(self) -> contextlib.ExitStack:
        """What a (re)compile, which happens inside a call, must see.

        No duck shaping: by default two dimensions that happen to be equal while compiling
        (say 2 rows and 2 kv heads) are assumed equal forever, and the graph is recompiled when
        they differ; every variable dimension gets its own symbol instead.
        """
        stack = contextlib.ExitStack()
        stack.enter_context(torch._inductor.config.patch(self._config))
        stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False))
        return stack

    def warm_up(self, cache: KVCache) -> float:
        """Compile every graph a serving run needs; returns the seconds it took.

        Writes keys and values at position 1 of slots 0 and 1, which are free before any
        request arrives: a request's prefill rewrites every position it later reads. (Position
        1, not 0: a cached length of 1 would be compiled as a constant, not as a variable.)
        """
        tic = time.perf_counter()
        cases = [[0]] if cache.num_slots == 1 else [[0], [1, 0]]
        for slots in cases:
            n = len(slots)
            log.info("compiling the decode step for %s", "one row" if n == 1 else "many rows")
            device = cache.keys[next(iter(cache.keys))].device
            self(torch.zeros((n, 1), dtype=torch.long, device=device),
                 torch.ones((n, 1), dtype=torch.long, device=device), cache,
                 torch.tensor(slots, device=device))
        return time.perf_counter() - tic

