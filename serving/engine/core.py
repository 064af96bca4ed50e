"""The generation engine: iteration-level (continuous) batching over a paged (or slot) KV cache.

`LLMEngine` implements `serving.types.Engine`. One thread runs the step loop: a background
thread by default, or the thread that calls `run()` (`background=False`). The asyncio side (the
HTTP layer) calls `generate`, which validates and queues the request at once (raising
`RequestError` or `Overloaded` before any work) and returns an async iterator that receives the
request's `GenerationOutput`s (`serving.engine.bridge`). Which thread should run the loop, and why it
matters on CPU: `serving.engine.bridge`.

The parts: `serving.engine.scheduler` decides each step (first come, first served, optional
priorities, a token budget, preemption), `serving.engine.kv_space` and `serving.engine.block_manager` hold the
KV cache's bookkeeping (a paged pool with prefix caching by default, `serving.engine.kv_config`; wave 1's
slots with `KVCacheConfig(kind="slots")`), `serving.engine.sampler` turns logits into tokens,
`serving.engine.validation` checks requests; the engine keeps the loop.

Each step:
1. aborts (a closed iterator) and timeouts are applied; finished requests free their KV;
2. the scheduler plans under a token budget (`max_step_tokens`): one token for every request
   in decode, then the next chunk of every prompt still being prefilled, then new requests are
   admitted while KV room, running room (`max_batch`) and budget are left; a long prompt is
   prefilled over several steps (chunked prefill); when blocks run out, the newest requests are
   preempted and later recomputed;
3. one forward pass for the rows of one token (decodes) and one for the longer prefill chunks,
   each returning the logits of just the positions that are needed (the last position of a
   completed prompt or a decode, every prompt position when prompt logprobs are asked for);
4. one batched sampling call for all rows (`core.sampling`), each row with its own settings and
   its own generator, so a request's tokens do not depend on what it was batched with; if the
   batched call fails, rows are retried one by one and only the failing request ends;
5. per request: stop tokens, stop strings, lengths, incremental text, and an output event.

Speculative decoding (`speculative=`, `serving.engine.speculative`): before planning, each decoding
request that can speculate gets up to k draft tokens (prompt lookup or a draft model); its row
runs its last token and the drafts (1 + k tokens, counted by the budget and the KV space), the
logits of every position are kept, exact rejection sampling decides what is emitted, the KV
cache is rolled back to the accepted tokens, and those go through step 5 one by one. Greedy
output is the plain greedy output; sampled output keeps its distribution.

Lengths: a prompt (plus a task's virtual tokens) must leave room for one new token in the
context (and in the whole KV pool), else the request is refused up front; generation then stops
at `max_tokens` or at the context (or the pool's size), whichever comes first (finish reason
"length").

Prefix caching (paged): a request starts on the cached blocks of its prefix (same tokens, same
task, same `cache_salt`, same LoRA adapter weights) and computes the rest; the output is the
same as without the cache. Requests asking for prompt logprobs compute their whole prompt (they
still publish blocks).

Per-request LoRA (`serving.engine.adapters`, with a runner built with `lora=`): a request names a
loaded adapter (`GenerationRequest.adapter`); its rows carry the adapter's slot in the step's
`StepBatch.adapters`, so one pass mixes adapters, tasks and plain rows. `load_adapter` /
`unload_adapter` (`serving.engine.adapter_ops`) change the loaded set while serving, on every rank.

Metrics: `stats()` returns gauges and counters; `add_observer(fn)` registers `fn(name, value)`,
called from the engine thread (keep it cheap and thread-safe, e.g. a Prometheus histogram's
`observe`) for each observation named in `OBSERVATIONS`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.core.model import GPTModel
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.core.sampling import choose_tokens, uniforms_from
from tessera.core.tokenizer import Tokenizer
from tessera.serving.engine.adapter_ops import AdapterOps
from tessera.serving.engine.adapters import AdapterRegistry
from tessera.serving.engine.block_manager import BlockHasher, BlockManager
from tessera.serving.engine.bridge import RequestStream, Sink
from tessera.serving.engine.detokenize import OutputText
from tessera.serving.engine.executor import (
    Executor,
    LocalExecutor,
    ModelRunner,
    StepBatch,
    StopServing,
    task_names,
)
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.kv_space import KVSpace, PagedSpace, SeqState, SlotSpace
from tessera.serving.engine.sampler import Sampler
from tessera.serving.engine.scheduler import Scheduler
from tessera.serving.engine.speculative import SpeculativeConfig, Speculator, build_speculator
from tessera.serving.engine.validation import Limits, request_problems
from tessera.serving.types import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    Overloaded,
    RequestError,
    SamplingParams,
    TokenLogprob,
)

log = logging.getLogger("tessera.serving")

# What observers receive: name -> meaning (all in seconds or tokens).
OBSERVATIONS = {
    "queue_time_seconds": "from submission to admission into the running batch",
    "time_to_first_token_seconds": "from submission to the first sampled token",
    "inter_token_latency_seconds": "between consecutive sampled tokens of a request",
    "e2e_request_latency_seconds": "from submission to the end of the request",
    "request_prompt_tokens": "prompt length of a finished request",
    "request_generation_tokens": "tokens sampled for a finished request",
}
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")
Observer = Callable[[str, float], None]


@dataclass(eq=False, kw_only=True)
class _Sequence(SeqState):
    """A request's state inside the engine (owned by the engine thread once queued).

    `tokens` (from `SeqState`): virtual placeholders + prompt + sampled tokens."""

    request: GenerationRequest
    sink: Sink
    n_input: int  # virtual placeholders + prompt
    n_virtual: int
    task: int  # task index, -1 for none
    max_new: int  # tokens it may sample (max_tokens, capped at the context)
    text: OutputText
    generator: torch.Generator | None
    arrival: float
    deadline: float | None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    counts: torch.Tensor | None = None  # (V,) occurrences in the output (presence/frequency)
    seen: torch.Tensor | None = None  # (V,) bool: in prompt or output (repetition penalty)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False
    aborted: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    adapter: int = -1  # per-request LoRA: the adapter's slot (serving.engine.adapters), -1 for none

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return self.n_input - self.n_virtual


class LLMEngine(AdapterOps):
    """Continuous-batching generation over one executor (one process, or rank 0 of many).

    Args:
        model: a `GPTModel` (or this process's stages), or an `Executor` (multi-rank serving).
        tokenizer: for text (`encode`, `decode`, output text, stop strings); without one,
            outputs carry token ids and empty text.
        tasks: prompt-tuned tasks, name -> virtual-token embeddings `(n_virtual, hidden)`
            (with an executor, give them to the executor's runner on every rank instead).
        max_batch: requests running at once (with slots: the cache's slots; an executor's
            runner has its own).
        max_queue: requests waiting to run before `generate` raises `Overloaded`.
        max_step_tokens: tokens per step (decodes + prefill chunks); at least `max_batch`.
        max_logprobs: the largest `logprobs` (top alternatives) a request may ask for.
        eos_id: the end-of-sequence id (default: the tokenizer's).
        seed: seeds the generators of requests that give no seed (default: from the OS).
        compile_decode: run decode passes compiled by TorchInductor (`serving.engine.compiled`: one
            process only; compiles for a while here, in the constructor).
        kv: the KV cache (`serving.engine.kv_config`): paged with prefix caching by default, slots
            with `compile_decode`. With an executor, its runner's cache is used and only
            `kv.prefix_caching` is read from here. `max_batch` then bounds the requests
            running at once, the pool's blocks their tokens.
        speculative: speculative decoding (`serving.engine.speculative`): n-gram prompt lookup or a
            draft model; None (the default) decodes one token per step.
    """

    def __init__(self, model: GPTModel | Sequence[GPTModel] | Executor,
                 tokenizer: Tokenizer | None = None, *, model_name: str = "tessera",
                 tasks: Mapping[str, torch.Tensor] | None = None, max_batch: int = 8,
                 max_queue: int = 128, max_step_tokens: int = 512, max_logprobs: int = 20,
                 eos_id: int | None = None, seed: int | None = None,
                 heartbeat_s: float = 1.0, background: bool = True,
                 compile_decode: bool = False, kv: KVCacheConfig | None = None,
                 speculative: SpeculativeConfig | None = None):
        if isinstance(model, (GPTModel, list, tuple)):
            if kv is None:
                kv = KVCacheConfig(kind="slots" if compile_decode else "paged")
            model = LocalExecutor(ModelRunner(model, max_batch, tasks,
                                              compile_decode=compile_decode, kv=kv))
        elif tasks or compile_decode:
            raise ValueError("with an executor, give tasks and compile_decode to its "
                             "ModelRunner (every rank)")
        self.executor: Executor = model
        runner = model.runner
        self.model_name, self.tokenizer = model_name, tokenizer
        self.config = runner.config
        self.max_batch, self.context = runner.max_batch, runner.max_seq
        self.max_queue, self.max_logprobs = max_queue, max_logprobs
        self.max_step_tokens = max(max_step_tokens, self.max_batch)
        self.device = runner.device
        self._task_len = dict(runner.tasks)
        self._task_index = {n: i for i, n in enumerate(task_names(runner.tasks))}
        self.pad_id = tokenizer.pad_id if tokenizer is not None else 0
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer else None)
        self.heartbeat_s = heartbeat_s
        self._seeds = random.Random(seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: deque[_Sequence] = deque()
        self.blocks: BlockManager | None = None  # the paged cache's bookkeeping
        self._space = self._kv_space(runner.cache, kv)
        self.scheduler = Scheduler(self._space, self.max_batch, self.max_step_tokens)
        self.sampler = Sampler(self.config.vocab_size, self.eos_id, self.device)
        self._observers: list[Observer] = []
        self._stop_callbacks: list[Callable[[], None]] = []
        self._closing = False
        self._alive = True
        self._kv_tokens = 0
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                          "requests_total": 0, "requests_rejected_total": 0, "steps_total": 0,
                          "computed_tokens_total": 0,
                          **{f"requests_finished_{r}_total": 0 for r in FINISH_REASONS}}
        self._looping = self._stopped = False
        # Per-request LoRA: the runner's adapter slots (serving.engine.adapters), None without --lora.
        self.adapters: AdapterRegistry | None = getattr(runner, "adapters", None)
        self._thread: threading.Thread | None = None
        # Speculative decoding (serving.engine.speculative)
        self.speculator: Speculator | None = None
        if speculative is not None:
            self.speculator = build_speculator(
                speculative, vocab_size=self.config.vocab_size, max_batch=self.max_batch,
                context=self.context, pad_id=self.pad_id, tokenizer=tokenizer,
                dtype=runner.dtype, device=self.device)
        self._counters.update(spec_draft_tokens_total=0, spec_accepted_tokens_total=0,
                              spec_verify_steps_total=0)
        if background:
            self._thread = threading.Thread(target=self._loop, name="tessera-engine", daemon=True)
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
        bos = add_bos and self.tokenizer.bos_id is not None
        return self.tokenizer.encode(text, bos=bos)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids)

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
        loop = asyncio.get_running_loop()
        seq = self._new_sequence(request, Sink(loop))
        stream = RequestStream(request.request_id, seq.sink, lambda: self._abort(seq))
        with self._lock:
            if self._closing or not self._alive:
                raise Overloaded("the engine is shutting down")
            waiting = self.scheduler.num_waiting
            if waiting >= self.max_queue:
                self._counters["requests_rejected_total"] += 1
                raise Overloaded(f"{waiting} requests are already waiting "
                                 f"(max_queue {self.max_queue}); retry later")
            self.scheduler.add(seq)
            self._counters["requests_total"] += 1
        self._wake.set()
        return stream

    def stats(self) -> dict[str, float]:
        """Gauges and counters. Paged cache: `kv_cache_usage` is the fraction of usable blocks
        held by requests; `kv_blocks_*`, `prefix_cache_{queries,hits}_tokens_total` (tokens
        of admitted requests that looked up the prefix cache, and of those found there) and
        `preemptions_total` come with it. Speculative decoding counts
        `spec_{draft,accepted}_tokens_total` and `spec_verify_steps_total` (0 without it)."""
        if self.blocks is not None:
            usage = self.blocks.num_used / self.blocks.num_usable
        else:
            usage = self._kv_tokens / (self.max_batch * self.context)
        out: dict[str, float] = {
            "running": len(self.scheduler.running), "waiting": self.scheduler.num_waiting,
            "kv_cache_usage": usage, "max_batch": self.max_batch,
            "max_queue": self.max_queue, "healthy": float(self._alive and not self._closing)}
        out.update(self._counters)
        if self.blocks is not None:
            out.update(kv_blocks_total=self.blocks.num_usable,
                       kv_blocks_used=self.blocks.num_used, kv_blocks_free=self.blocks.num_free,
                       kv_blocks_cached=self.blocks.num_cached,
                       kv_block_evictions_total=self.blocks.evictions,
                       prefix_cache_queries_tokens_total=self.scheduler.prefix_queried_tokens,
                       prefix_cache_hits_tokens_total=self.scheduler.prefix_hit_tokens)
        out["preemptions_total"] = self.scheduler.preemptions
        return out

    # ----------------------------------------------------------------- lifecycle and hooks

    def add_observer(self, fn: Observer) -> None:
        """Call `fn(name, value)` for every observation (see `OBSERVATIONS`)."""
        self._observers.append(fn)

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the engine thread) when the engine stops for any reason, e.g. a
        worker rank asked to stop: the HTTP server should then exit too."""
        self._stop_callbacks.append(fn)

    @property
    def alive(self) -> bool:
        return self._alive

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
        self._loop(until)

    def wake(self) -> None:
        """Cut short an idle loop's wait (thread-safe)."""
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish outstanding requests as aborted, release the other ranks, stop the loop.

        Waits for a background loop to end; a loop in `run()` ends at its next check."""
        self._closing = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)
        elif thread is None and not self._looping:  # no loop to notice: stop here
            self._stop(stopped_by_rank=False)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- admission

    def _kv_space(self, cache, kv: KVCacheConfig | None) -> KVSpace:
        """The scheduler's view of the runner's cache; sets `blocks` and the request limits."""
        kv_tokens = None
        if isinstance(cache, PagedKVCache):
            prefix = kv.prefix_caching if kv is not None else True
            self.blocks = BlockManager(cache.num_blocks, cache.block_size, prefix)
            space: KVSpace = PagedSpace(self.blocks)
            kv_tokens = self.blocks.num_usable * cache.block_size
        else:
            space = SlotSpace(self.max_batch)
        self._kv_limit = min(self.context, kv_tokens or self.context)
        self._limits = Limits(self.config.vocab_size, self.context, dict(self._task_len),
                              self.max_logprobs, self.tokenizer is not None,
                              kv_tokens if kv_tokens is not None and kv_tokens < self.context
                              else None)
        return space

    def _new_sequence(self, request: GenerationRequest, sink: Sink) -> _Sequence:
        p = request.params
        n_virtual = self._task_len.get(request.task, 0) if request.task else 0
        tokens = [self.pad_id] * n_virtual + list(request.prompt_ids)
        generator = None
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator().manual_seed(seed % (1 << 64))
        now = time.monotonic()
        seq = _Sequence(
            request=request, sink=sink, tokens=tokens, n_input=len(tokens),
            priority=request.priority, hasher=None, reuse_prefix=not p.prompt_logprobs,
            n_virtual=n_virtual, task=self._task_index.get(request.task, -1) if request.task else -1,
            max_new=min(p.max_tokens, self._kv_limit - len(tokens)),
            text=OutputText(self.tokenizer, list(request.prompt_ids), p.stop),
            generator=generator, arrival=now,
            deadline=now + request.timeout_s if request.timeout_s else None,
            stop_ids=frozenset(p.stop_token_ids))
        if p.prompt_logprobs:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
        adapter_id = self._bind_adapter(seq) if request.adapter is not None else None
        if self.blocks is not None and self.blocks.prefix_caching:
            # The namespace keeps tasks, adapters and tenants apart: equal tokens, different KV.
            # An adapter counts by the ident of its load (its weights), not its name.
            seq.hasher = BlockHasher(self.blocks.block_size,
                                     (request.task, adapter_id, request.cache_salt))
        return seq

    def _abort(self, seq: _Sequence) -> None:
        """Thread-safe: ask the engine thread to drop `seq`."""
        with self._lock:
            self._aborts.append(seq)
        self._wake.set()

    # ----------------------------------------------------------------- the step loop

    def _loop(self, until: threading.Event | None = None) -> None:
        """Steps until shutdown, a stopped rank, or (if given) `until` is set while no request
        is in the engine; only the first two stop the engine."""
        stopped_by_rank = False
        paused = False
        self._looping = True
        try:
            while True:
                self._wake.clear()
                self._apply_aborts()
                if self._closing:
                    break
                self._expire(time.monotonic())
                if not self.scheduler.running and not self.scheduler.num_waiting:
                    if until is not None and until.is_set():
                        paused = True
                        break
                    if not self._wake.wait(self.heartbeat_s) and not self.executor.heartbeat():
                        stopped_by_rank = True
                        break
                    continue
                try:
                    self._step()
                except StopServing:
                    raise
                except Exception as exc:  # a bug: fail what was running, keep serving
                    log.exception("engine step failed")
                    for seq in list(self.scheduler.running):
                        self._finish(seq, "error", f"engine step failed: {exc}")
        except StopServing as exc:
            log.warning("serving stops: %s", exc)
            stopped_by_rank = True
        except BaseException:
            log.exception("the engine loop died")
        finally:
            self._looping = False
            if not paused:
                self._stop(stopped_by_rank)

    def _stop(self, stopped_by_rank: bool) -> None:
        """Once: fail what is left, release the other ranks, call the stop callbacks."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._alive = False
        self._fail_all("the server is shutting down")
        if not stopped_by_rank:
            try:
                self.executor.close()
            except Exception:
                log.exception("could not release the other ranks")
        for fn in self._stop_callbacks:
            try:
                fn()
            except Exception:
                log.exception("stop callback failed")

    def _fail_all(self, message: str) -> None:
        for seq in self.scheduler.drain():
            self._finish(seq, "abort", message)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = list(self._aborts), deque()
        for seq in aborts:
            if not seq.finished:
                seq.aborted = True
                self._finish(seq, "abort")

    def _expire(self, now: float) -> None:
        late = self.scheduler.remove_waiting(lambda s: s.deadline is not None and now > s.deadline)
        late += [s for s in self.scheduler.running
                 if s.deadline is not None and now > s.deadline]
        for seq in late:
            self._finish(seq, "timeout")

    def _step(self) -> None:
        now = time.monotonic()
        if self.speculator is not None:  # drafts first: the scheduler counts their tokens
            self.speculator.propose(self.scheduler.running, self.max_step_tokens)
        step = self.scheduler.schedule()
        for seq in step.admitted:
            if seq.preemptions == 0:
                self._observe("queue_time_seconds", now - seq.arrival)
        plan = step.rows
        if self.speculator is not None:
            self.speculator.fit(plan, self.scheduler.running + step.preempted)
        self._counters["steps_total"] += 1
        to_sample: list[tuple[_Sequence, torch.Tensor]] = []
        to_verify: list[tuple[_Sequence, list[int], torch.Tensor]] = []
        done_prefill: list[_Sequence] = []
        # Rows of one token (decodes) and longer prefill chunks run as separate passes, so
        # neither pads to the other's length. Speculative rows (a decode and its drafts) join
        # the decodes: padding a decode to 1 + k tokens costs less than a second pass over the
        # weights. Rows in slot order: with the lowest free slot taken first, running slots are
        # usually consecutive and the eager KV cache reads them as a view instead of gathering
        # a copy (a compiled decode step always gathers).
        decodes = [r for r in plan if r[1] == 1 or r[0].draft]
        for group in (decodes, [r for r in plan if r[1] > 1 and not r[0].draft]):
            group.sort(key=lambda row: row[0].slot)
            if group:
                self._run_group(group, to_sample, done_prefill, to_verify)
        for seq in done_prefill:  # max_tokens 0: prompt scored, nothing to sample
            self._finish(seq, "length")
        if to_sample:
            self._sample_and_advance(to_sample)
        if to_verify:
            self._verify_and_advance(to_verify)
        self._kv_tokens = sum(s.cached for s in self.scheduler.running)

    def _run_group(self, group: list[tuple[_Sequence, int]],
                   to_sample: list[tuple[_Sequence, torch.Tensor]],
                   done_prefill: list[_Sequence],
                   to_verify: list[tuple[_Sequence, list[int], torch.Tensor]]) -> None:
        B, T = len(group), max(n for _, n in group)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        positions = torch.empty((B, T), dtype=torch.long)
        keep: list[int] = []
        wanted: list[tuple[_Sequence, int | None]] = []  # (seq, prompt position or None=sample)
        drafted: list[tuple[_Sequence, int]] = []  # speculative rows: logits at every position
        for r, (seq, n) in enumerate(group):
            start = seq.cached
            if seq.draft:  # the last token, then the drafts (n = 1 + len(draft))
                ids[r, :n] = torch.tensor(seq.tokens[start:] + seq.draft)
                positions[r] = torch.arange(start, start + T).clamp(max=self.context - 1)
                drafted.append((seq, r))
                continue
            ids[r, :n] = torch.tensor(seq.tokens[start:start + n])
            # Padding continues the positions (clipped to the cache): it writes keys nobody
            # attends to, past the row's real tokens, which later tokens overwrite.
            positions[r] = torch.arange(start, start + T).clamp(max=self.context - 1)
            if seq.prompt_logprobs is not None:
                for t in range(max(start, seq.n_virtual), min(start + n, seq.n_input - 1)):
                    keep.append(r * T + t - start)
                    wanted.append((seq, t))
            if start + n == len(seq.tokens):
                keep.append(r * T + n - 1)
                wanted.append((seq, None))
        n_wanted = len(keep)
        for seq, r in drafted:
            keep.extend(r * T + j for j in range(len(seq.draft) + 1))
        rows = self._space.rows([s for s, _ in group], int(positions.max()) + 1)
        batch = StepBatch(ids, positions, rows, torch.tensor([s.task for s, _ in group]),
                          torch.tensor(keep, dtype=torch.long), self._adapter_rows(group))
        try:
            logits = self.executor.run(batch)
        except StopServing:
            raise
        except Exception as exc:
            log.exception("forward pass failed")
            for seq, _ in group:
                self._finish(seq, "error", f"forward pass failed: {exc}")
            return
        for seq, n in group:
            seq.cached += n
            if not seq.draft:  # a speculative row publishes blocks once verified
                self._space.computed(seq)
            self._counters["computed_tokens_total"] += n
        at = n_wanted
        for seq, _ in drafted:
            draft, seq.draft = seq.draft, []
            if not seq.finished:
                to_verify.append((seq, draft, logits[at:at + len(draft) + 1]))
            at += len(draft) + 1
        self.sampler.score_prompts(wanted, logits)
        for i, (seq, t) in enumerate(wanted):
            if t is None and not seq.finished:
                if seq.max_new == 0:
                    done_prefill.append(seq)
                else:
                    to_sample.append((seq, logits[i]))

    # ----------------------------------------------------------------- sampling

    def _sample_and_advance(self, rows: list[tuple[_Sequence, torch.Tensor]]) -> None:
        seqs = [s for s, _ in rows]
        logits = torch.stack([row for _, row in rows])
        uniforms = uniforms_from([s.generator for s in seqs])
        try:
            tokens = self.sampler.choose(seqs, logits, uniforms, choose_tokens).tolist()
        except Exception:
            tokens = []
            for i, seq in enumerate(seqs):  # find the request at fault; the others go on
                try:
                    tokens.append(int(self.sampler.choose([seq], logits[i:i + 1],
                                                          uniforms[i:i + 1], choose_tokens)[0]))
                except Exception as exc:
                    log.exception("sampling failed for request %s", seq.request.request_id)
                    tokens.append(None)
                    self._finish(seq, "error", f"sampling failed: {exc}")
        lps = self.sampler.sampled_logprobs(seqs, logits, tokens)
        now = time.monotonic()
        for seq, token, lp in zip(seqs, tokens, lps):
            if token is None or seq.finished:
                continue
            try:
                self._advance(seq, token, lp, now)
            except Exception as exc:
                log.exception("request %s failed", seq.request.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _verify_and_advance(self, rows: list[tuple[_Sequence, list[int], torch.Tensor]]) -> None:
        """Speculative rows: verify each request's drafts against the target's logits, cut its
        KV cache back to the accepted tokens, then advance it token by token (stops and
        lengths cut exactly where plain decoding would)."""
        now = time.monotonic()
        for seq, draft, logits in rows:
            if seq.finished:
                continue
            n_before = len(seq.tokens)
            try:
                tokens = self.speculator.verify(seq, draft, logits)
            except Exception as exc:
                log.exception("speculative verification failed for %s", seq.request.request_id)
                self._finish(seq, "error", f"sampling failed: {exc}")
                continue
            accepted = len(tokens) - 1
            # Keys and values of the last token and the accepted drafts stay; rejected go.
            self._space.rollback(seq, n_before + accepted)
            self.speculator.accepted(seq, n_before, accepted)
            self._counters["spec_verify_steps_total"] += 1
            self._counters["spec_draft_tokens_total"] += len(draft)
            self._counters["spec_accepted_tokens_total"] += accepted
            try:
                # Row j's logits predicted emitted token j: its logprobs, as plain decoding's.
                lps = self.sampler.sampled_logprobs([seq] * len(tokens), logits[:len(tokens)],
                                                    tokens)
                for token, lp in zip(tokens, lps):
                    self._advance(seq, token, lp, now)
                    if seq.finished:
                        break
                else:
                    self._space.computed(seq)  # now only verified tokens: publish full blocks
            except Exception as exc:
                log.exception("request %s failed", seq.request.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------- per request

    def _advance(self, seq: _Sequence, token: int, lp: TokenLogprob | None, now: float) -> None:
        p = seq.params
        seq.tokens.append(token)
        seq.n_generated += 1
        self._counters["generation_tokens_total"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._counters["prompt_tokens_total"] += seq.prompt_len
            self._observe("time_to_first_token_seconds", now - seq.arrival)
        else:
            self._observe("inter_token_latency_seconds", now - seq.last_token_at)
        seq.last_token_at = now
        self.sampler.track(seq, token)
        if (token == self.eos_id and not p.ignore_eos) or token in seq.stop_ids:
            self._finish(seq, "stop")
            return
        if seq.text.add(token, lp, check_stop=seq.n_generated >= p.min_tokens):
            self._finish(seq, "stop")
        elif seq.n_generated >= seq.max_new:
            self._finish(seq, "length")
        else:
            self._emit(seq)

    def _emit(self, seq: _Sequence, reason: FinishReason | None = None,
              error: str | None = None) -> None:
        final = reason is not None
        ids, text, lps = seq.text.take(final=final)
        if not final and not ids and not text:
            return
        prompt_lps = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_lps, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        out = GenerationOutput(
            request_id=seq.request.request_id, token_ids=ids, text=text,
            logprobs=lps if seq.params.logprobs is not None else None,
            prompt_logprobs=prompt_lps, finished=final, finish_reason=reason,
            prompt_tokens=seq.prompt_len, completion_tokens=seq.n_generated, error=error)
        if not seq.sink.deliver(out) and not final:
            self._abort(seq)  # nobody is listening any more

    def _finish(self, seq: _Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        self.scheduler.finish(seq)
        self._counters[f"requests_finished_{reason}_total"] += 1
        self._kv_tokens = sum(s.cached for s in self.scheduler.running)
        if seq.first_token_at is None:
            self._counters["prompt_tokens_total"] += seq.prompt_len
        self._observe("e2e_request_latency_seconds", time.monotonic() - seq.arrival)
        self._observe("request_prompt_tokens", seq.prompt_len)
        self._observe("request_generation_tokens", seq.n_generated)
        if seq.aborted:
            return  # the client is gone
        if reason == "error" and error is None:
            error = "internal error"
        try:
            self._emit(seq, reason, error)
        except Exception as exc:  # never leave a client without its final event
            log.exception("could not build the final output of %s", seq.request.request_id)
            seq.sink.deliver(GenerationOutput(
                seq.request.request_id, [], "", finished=True, finish_reason="error",
                prompt_tokens=seq.prompt_len, completion_tokens=seq.n_generated,
                error=f"{type(exc).__name__}: {exc}"))

    def _observe(self, name: str, value: float) -> None:
        for fn in self._observers:
            try:
                fn(name, float(value))
            except Exception:
                log.exception("metrics observer failed on %s", name)
