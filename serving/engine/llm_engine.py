"""`LLMEngine`: the generation engine the HTTP layer talks to (`serving.types.Engine`).

One thread runs the step loop (`serving.engine.core.EngineCore`): a background thread by
default, or the thread that calls `run()` (`background=False`; which thread should, and why it
matters on CPU: `serving.engine.bridge`). The asyncio side calls `generate`, which validates and
queues the request at once (raising `RequestError` or `Overloaded` before any work) and returns
an async iterator of the request's `GenerationOutput`s.

Lengths: a prompt (plus a task's virtual tokens) must leave room for one new token in the
context (and in the whole KV pool), else the request is refused up front; generation then stops
at `max_tokens` or at the context (or the pool's size), whichever comes first ("length").
Prefix caching (paged) never changes an output: a request starts on the cached blocks of its
prefix (same tokens, task, `cache_salt` and LoRA weights) and computes the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from tessera.core.models.decoder.model import GPTModel
from tessera.core.rope_scaling import length_dependent, recompute_at
from tessera.core.tokenizer import Tokenizer
from tessera.serving.engine.adapter_ops import AdapterOps
from tessera.serving.engine.bridge import RequestStream, Sink
from tessera.serving.engine.core import EngineCore
from tessera.serving.engine.executor import Executor, LocalExecutor
from tessera.serving.engine.grammar import GrammarCompiler
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.kv_space import kv_space_for
from tessera.serving.engine.outputs import OutputProcessor
from tessera.serving.engine.request import EngineRequest, RequestBuilder
from tessera.serving.engine.runner import ModelRunner, task_names
from tessera.serving.engine.sampler import Sampler
from tessera.serving.engine.scheduler import Scheduler
from tessera.serving.engine.speculative import SpeculativeConfig, build_speculator
from tessera.serving.engine.stats import EngineStats, Observer
from tessera.serving.engine.validation import Limits, request_problems
from tessera.serving.types import GenerationRequest, Overloaded, RequestError


class LLMEngine:
    """Continuous-batching generation over one executor (one process, or rank 0 of many).

    Args:
        model: a `GPTModel` (or this process's stages), or an `Executor` (multi-rank serving).
        tokenizer: for text (`encode`, `decode`, output text, stop strings); without one,
            outputs carry token ids and empty text.
        tasks: prompt-tuned tasks, name -> virtual-token embeddings `(n_virtual, hidden)`
            (with an executor, give them to the executor's runner on every rank instead).
        max_batch: requests running at once (an executor's runner has its own).
        max_queue: requests waiting to run before `generate` raises `Overloaded`.
        max_step_tokens: tokens per step (decodes + prefill chunks); at least `max_batch`.
        max_logprobs: the largest `logprobs` (top alternatives) a request may ask for.
        eos_id: the end-of-sequence id, or several (a `generation_config.json` list: the first
            is the EOS, every one ends a request that does not ignore EOS; default: the
            tokenizer's).
        seed: seeds the generators of requests that give no seed (default: from the OS).
        compile_decode: run decode passes through the static-shape step with its block
            compiled (`serving.engine.compiled`: one process only; compiles for a while here,
            in the constructor); a string picks the backend (`ModelRunner`).
        kv: the KV cache (`serving.engine.kv_config`): paged with prefix caching by default.
            With an executor, its runner's cache is used and only
            `kv.prefix_caching` is read from here.
        speculative: speculative decoding (`serving.engine.speculative`): n-gram prompt lookup
            or a draft model; None (the default) decodes one token per step.
    """

    def __init__(self, model: GPTModel | Sequence[GPTModel] | Executor,
                 tokenizer: Tokenizer | None = None, *, model_name: str = "tessera",
                 tasks: Mapping[str, torch.Tensor] | None = None, max_batch: int = 8,
                 max_queue: int = 128, max_step_tokens: int = 512, max_logprobs: int = 20,
                 eos_id: int | Sequence[int] | None = None, seed: int | None = None,
                 heartbeat_s: float = 1.0, background: bool = True,
                 compile_decode: bool | str = False, kv: KVCacheConfig | None = None,
                 speculative: SpeculativeConfig | None = None):
        if isinstance(model, (GPTModel, list, tuple)):
            if kv is None:
                kv = KVCacheConfig(kind="paged")
            model = LocalExecutor(ModelRunner(model, max_batch, tasks,
                                              compile_decode=compile_decode, kv=kv))
        elif tasks or compile_decode:
            raise ValueError("with an executor, give tasks and compile_decode to its "
                             "ModelRunner (every rank)")
        self.executor: Executor = model
        runner = model.runner
        self.model_name, self.tokenizer, self.config = model_name, tokenizer, runner.config
        self.max_batch, self.context = runner.max_batch, runner.max_seq
        self.max_queue = max_queue
        self.pad_id = tokenizer.pad_id if tokenizer is not None else 0
        eos_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
        self.eos_id = eos_ids[0] if eos_ids else (tokenizer.eos_id if tokenizer else None)
        if kv is not None and kv.prefix_caching and length_dependent(self.config):
            # Keys rotated for one request's length are not another's: nothing to share.
            kv = dataclasses.replace(kv, prefix_caching=False)
        space, self.blocks, kv_tokens = kv_space_for(runner.cache, kv, self.max_batch)
        self._task_len = dict(runner.tasks)
        self._limits = Limits(self.config.vocab_size, self.context, dict(self._task_len),
                              max_logprobs, tokenizer is not None,
                              kv_tokens if kv_tokens is not None and kv_tokens < self.context
                              else None)
        # Per-request LoRA: the runner's adapter slots (serving.engine.adapters), or none.
        self.adapters = AdapterOps(runner.adapters, model, self._task_len)
        self.requests = RequestBuilder(
            tokenizer, self.pad_id, task_len=self._task_len,
            task_index={n: i for i, n in enumerate(task_names(runner.tasks))},
            kv_limit=min(self.context, kv_tokens or self.context), blocks=self.blocks,
            adapters=self.adapters, seed=seed, eos_stop_ids=eos_ids[1:])
        self.scheduler = Scheduler(space, self.max_batch, max(max_step_tokens, self.max_batch))
        self.scheduler.recompute_at = recompute_at(self.config)
        self.grammars = GrammarCompiler(tokenizer, self.config.vocab_size, self.eos_id)
        speculator = None if speculative is None else build_speculator(
            speculative, vocab_size=self.config.vocab_size, max_batch=self.max_batch,
            context=self.context, pad_id=self.pad_id, tokenizer=tokenizer,
            dtype=runner.dtype, device=runner.device)
        self.speculator, self.metrics = speculator, EngineStats()
        self.core = EngineCore(
            model, self.scheduler,
            OutputProcessor(self.scheduler, Sampler(self.config.vocab_size, self.eos_id,
                                                    runner.device),
                            speculator, self.metrics, self.eos_id, self._abort),
            self.metrics, pad_id=self.pad_id, speculator=speculator, heartbeat_s=heartbeat_s)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self.core.run_loop, name="tessera-engine",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str = "cpu", max_batch: int = 8,
                        tasks: Mapping[str, torch.Tensor] | None = None,
                        model_name: str | None = None, quantize_with: str = "none",
                        **kwargs) -> LLMEngine:
        """A single-process engine for the checkpoint at `path` (any saved layout, FP8
        dequantized), with its tokenizer when it has one; `quantize_with="int8"` quantizes the
        weights (`core.quantize`; give `dtype="bf16"`). `kwargs` go to the constructor."""
        from tessera.core.checkpoint import load_checkpoint, read_manifest
        from tessera.core.quantize import quantize
        from tessera.core.tokenizer import load_tokenizer

        manifest = read_manifest(path)
        model = quantize(load_checkpoint(path, dtype=dtype, device=device), quantize_with)
        tokenizer = load_tokenizer(path) if manifest.tokenizer else None
        return cls(model, tokenizer, model_name=model_name or Path(path).name, tasks=tasks,
                   max_batch=max_batch, **kwargs)

    # ----------------------------------------------------------------- the Engine protocol

    def tasks(self) -> list[str]:
        return sorted(self._task_len)

    def max_context(self) -> int:
        return self.context

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: send token ids")
        bos = add_bos and self.tokenizer.adds_bos
        return self.tokenizer.encode(text, bos=bos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def validate(self, request: GenerationRequest) -> None:
        problems = request_problems(request, self._limits)
        if problems:
            raise RequestError("; ".join(problems))

    def generate(self, request: GenerationRequest) -> RequestStream:
        """Queue `request` and return its stream of outputs (see `RequestStream`).

        Must be called from a running event loop. Raises `RequestError` (bad request) or
        `Overloaded` (queue full, or the engine is stopping) at once, before any work.
        """
        self.validate(request)
        structured = request.params.structured
        grammar = None if structured is None else self.grammars.matcher(
            structured, request.params.stop_token_ids)
        seq = self.requests.build(request, Sink(asyncio.get_running_loop()))
        seq.grammar = grammar
        stream = RequestStream(request.request_id, seq.sink, lambda: self._abort(seq))
        with self.core.lock:
            if self.core.closing or not self.core.alive:
                raise Overloaded("the engine is shutting down")
            waiting = self.scheduler.num_waiting
            if waiting >= self.max_queue:
                self.metrics.count("requests_rejected_total")
                raise Overloaded(f"{waiting} requests are already waiting "
                                 f"(max_queue {self.max_queue}); retry later")
            self.scheduler.add(seq)
            self.metrics.count("requests_total")
        self.core.wake.set()
        return stream

    def stats(self) -> dict[str, float]:
        """Gauges and counters. Paged cache: `kv_cache_usage` is the fraction of usable blocks
        held by requests; `kv_blocks_*`, `prefix_cache_{queries,hits}_tokens_total` (tokens
        of admitted requests that looked up the prefix cache, and of those found there) and
        `preemptions_total` come with it. Speculative decoding counts
        `spec_{draft,accepted}_tokens_total` and `spec_verify_steps_total` (0 without it)."""
        b, s = self.blocks, self.scheduler
        usage = (b.num_used / b.num_usable if b is not None
                 else self.metrics.kv_tokens / (self.max_batch * self.context))
        out: dict[str, float] = {
            "running": len(s.running), "waiting": s.num_waiting, "kv_cache_usage": usage,
            "max_batch": self.max_batch, "max_queue": self.max_queue,
            "healthy": float(self.core.alive and not self.core.closing), **self.metrics.counters}
        if b is not None:
            out.update(kv_blocks_total=b.num_usable, kv_blocks_used=b.num_used,
                       kv_blocks_free=b.num_free, kv_blocks_cached=b.num_cached,
                       kv_block_evictions_total=b.evictions,
                       kv_blocks_peak_used=b.peak_used,
                       kv_block_window_frees_total=b.window_frees,
                       prefix_cache_queries_tokens_total=s.prefix_queried_tokens,
                       prefix_cache_hits_tokens_total=s.prefix_hit_tokens)
        out["preemptions_total"] = s.preemptions
        return out

    # ----------------------------------------------------------------- per-request LoRA

    def adapter_names(self) -> list[str]:
        """The LoRA adapters loaded now, by name."""
        return self.adapters.names()

    def load_adapter(self, name: str, path: str | Path) -> str:
        """Load adapter `path` as `name` while serving, on every rank (`AdapterOps.load`)."""
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot on every rank (`AdapterOps.unload`)."""
        self.adapters.unload(name)

    # ----------------------------------------------------------------- lifecycle and hooks

    def add_observer(self, fn: Observer) -> None:
        """Call `fn(name, value)` from the engine thread for every observation
        (`serving.engine.stats.OBSERVATIONS`); keep it cheap and thread-safe."""
        self.metrics.add_observer(fn)

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the engine thread) when the engine stops for any reason, e.g. a
        worker rank asked to stop: the HTTP server should then exit too."""
        self.core.stop_callbacks.append(fn)

    @property
    def alive(self) -> bool:
        return self.core.alive

    @property
    def background(self) -> bool:
        """Whether the step loop runs on the engine's own thread (else in `run()`)."""
        return self._thread is not None

    def run(self, until: threading.Event | None = None) -> None:
        """Run the step loop in the calling thread until `shutdown()` (from another thread or a
        signal handler) or a stopped rank; for engines built with `background=False`.

        With `until`: also return, leaving the engine usable, once it is set and no request
        is left (call `wake()` after setting it, so an idle loop notices at once)."""
        if self.background:
            raise RuntimeError("this engine runs its step loop on a background thread already")
        self.core.run_loop(until)

    def wake(self) -> None:
        """Cut short an idle loop's wait (thread-safe)."""
        self.core.wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish outstanding requests as aborted, release the other ranks, stop the loop.

        Waits for a background loop to end; a loop in `run()` ends at its next check."""
        self.core.closing = True
        self.core.wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)
        elif thread is None and not self.core.looping:  # no loop to notice: stop here
            self.core.stop(stopped_by_rank=False)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _abort(self, seq: EngineRequest) -> None:
        self.core.abort(seq)
