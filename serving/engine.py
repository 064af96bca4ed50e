"""The generation engine: iteration-level (continuous) batching over a slot-addressed KV cache.

`LLMEngine` implements `serving.types.Engine`. One thread runs the step loop: a background
thread by default, or the thread that calls `run()` (`background=False`). The asyncio side (the
HTTP layer) calls `generate`, which validates and queues the request at once (raising
`RequestError` or `Overloaded` before any work) and returns an async iterator that receives the
request's `GenerationOutput`s (`serving.bridge`). Which thread should run the loop, and why it
matters on CPU: `serving.bridge`.

Each step:
1. aborts (a closed iterator) and timeouts are applied; finished requests free their slot;
2. the schedule is made under a token budget (`max_step_tokens`): one token for every request
   in decode, then the next chunk of every prompt still being prefilled, then new requests are
   admitted while a KV-cache slot is free and budget is left; a long prompt is prefilled over
   several steps;
3. one forward pass for the rows of one token (decodes) and one for the longer prefill chunks,
   each returning the logits of just the positions that are needed (the last position of a
   completed prompt or a decode, every prompt position when prompt logprobs are asked for);
4. one batched sampling call for all rows (`core.sampling`), each row with its own settings and
   its own generator, so a request's tokens do not depend on what it was batched with; if the
   batched call fails, rows are retried one by one and only the failing request ends;
5. per request: stop tokens, stop strings, lengths, incremental text, and an output event.

Lengths: a prompt (plus a task's virtual tokens) must leave room for one new token in the
context, else the request is refused up front; generation then stops at `max_tokens` or at the
context, whichever comes first (finish reason "length").

Metrics: `stats()` returns gauges and counters; `add_observer(fn)` registers `fn(name, value)`,
called from the engine thread (keep it cheap and thread-safe, e.g. a Prometheus histogram's
`observe`) for each observation named in `OBSERVATIONS`.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.core.model import GPTModel
from tessera.core.sampling import (
    RowSettings,
    apply_penalties,
    choose_tokens,
    token_logprobs,
    uniforms_from,
)
from tessera.core.tokenizer import Tokenizer
from tessera.serving.bridge import RequestStream, Sink
from tessera.serving.detokenize import OutputText
from tessera.serving.executor import (
    Executor,
    LocalExecutor,
    ModelRunner,
    StepBatch,
    StopServing,
    task_names,
)
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


@dataclass(eq=False)
class _Sequence:
    """A request's state inside the engine (owned by the engine thread once queued)."""

    request: GenerationRequest
    sink: Sink
    tokens: list[int]  # virtual placeholders + prompt + sampled tokens
    n_input: int  # virtual placeholders + prompt
    n_virtual: int
    task: int  # task index, -1 for none
    max_new: int  # tokens it may sample (max_tokens, capped at the context)
    text: OutputText
    generator: torch.Generator | None
    arrival: float
    deadline: float | None
    slot: int = -1
    cached: int = 0  # tokens whose keys and values are in the cache
    n_generated: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    counts: torch.Tensor | None = None  # (V,) occurrences in the output (presence/frequency)
    seen: torch.Tensor | None = None  # (V,) bool: in prompt or output (repetition penalty)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False
    aborted: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return self.n_input - self.n_virtual


class LLMEngine:
    """Continuous-batching generation over one executor (one process, or rank 0 of many).

    Args:
        model: a `GPTModel` (or this process's stages), or an `Executor` (multi-rank serving).
        tokenizer: for text (`encode`, `decode`, output text, stop strings); without one,
            outputs carry token ids and empty text.
        tasks: prompt-tuned tasks, name -> virtual-token embeddings `(n_virtual, hidden)`
            (with an executor, give them to the executor's runner on every rank instead).
        max_batch: KV-cache slots, i.e. requests running at once (an executor's runner has
            its own).
        max_queue: requests waiting for a slot before `generate` raises `Overloaded`.
        max_step_tokens: tokens per step (decodes + prefill chunks); at least `max_batch`.
        max_logprobs: the largest `logprobs` (top alternatives) a request may ask for.
        eos_id: the end-of-sequence id (default: the tokenizer's).
        seed: seeds the generators of requests that give no seed (default: from the OS).
        compile_decode: run decode passes compiled by TorchInductor (`serving.compiled`: one
            process only; compiles for a while here, in the constructor).
    """

    def __init__(self, model: GPTModel | Sequence[GPTModel] | Executor,
                 tokenizer: Tokenizer | None = None, *, model_name: str = "tessera",
                 tasks: Mapping[str, torch.Tensor] | None = None, max_batch: int = 8,
                 max_queue: int = 128, max_step_tokens: int = 512, max_logprobs: int = 20,
                 eos_id: int | None = None, seed: int | None = None,
                 heartbeat_s: float = 1.0, background: bool = True,
                 compile_decode: bool = False):
        if isinstance(model, (GPTModel, list, tuple)):
            model = LocalExecutor(ModelRunner(model, max_batch, tasks,
                                              compile_decode=compile_decode))
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
        self._waiting: deque[_Sequence] = deque()
        self._aborts: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(self.max_batch))  # a heap: the lowest free slot first
        self._observers: list[Observer] = []
        self._stop_callbacks: list[Callable[[], None]] = []
        self._closing = False
        self._alive = True
        self._kv_tokens = 0
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                          "requests_total": 0, "requests_rejected_total": 0, "steps_total": 0,
                          **{f"requests_finished_{r}_total": 0 for r in FINISH_REASONS}}
        self._looping = self._stopped = False
        self._thread: threading.Thread | None = None
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
        problems = self._problems(request)
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
            if len(self._waiting) >= self.max_queue:
                self._counters["requests_rejected_total"] += 1
                raise Overloaded(f"{len(self._waiting)} requests are already waiting "
                                 f"(max_queue {self.max_queue}); retry later")
            self._waiting.append(seq)
            self._counters["requests_total"] += 1
        self._wake.set()
        return stream

    def stats(self) -> dict[str, float]:
        capacity = self.max_batch * self.context
        out: dict[str, float] = {
            "running": len(self._running), "waiting": len(self._waiting),
            "kv_cache_usage": self._kv_tokens / capacity, "max_batch": self.max_batch,
            "max_queue": self.max_queue, "healthy": float(self._alive and not self._closing)}
        out.update(self._counters)
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

    def _problems(self, request: GenerationRequest) -> list[str]:
        p, ids, vocab = request.params, request.prompt_ids, self.config.vocab_size
        out: list[str] = []
        if not ids:
            out.append("the prompt is empty: give at least one token (e.g. BOS)")
        elif min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i in ids if i < 0 or i >= vocab)
            out.append(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        n_virtual = 0
        if request.task is not None:
            if request.task not in self._task_len:
                served = ", ".join(sorted(self._task_len)) or "none"
                out.append(f"unknown task {request.task!r} (tasks served: {served})")
            else:
                n_virtual = self._task_len[request.task]
        total = len(ids) + n_virtual
        if total >= self.context:
            extra = f" + {n_virtual} virtual tokens of task {request.task!r}" if n_virtual else ""
            out.append(f"the prompt has {len(ids)} tokens{extra}, but the context is "
                       f"{self.context}: at most {self.context - 1 - n_virtual} prompt tokens "
                       "fit (one position is needed for the first new token)")
        if p.max_tokens < 0:
            out.append(f"max_tokens must be >= 0, got {p.max_tokens}")
        if p.min_tokens < 0 or p.min_tokens > max(p.max_tokens, 0):
            out.append(f"min_tokens must be in [0, max_tokens {p.max_tokens}], got {p.min_tokens}")
        if not math.isfinite(p.temperature) or p.temperature < 0:
            out.append(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
        if p.top_k < -1:
            out.append(f"top_k must be >= 0 (0 or -1: no cut), got {p.top_k}")
        if not 0 < p.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {p.top_p}")
        if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
            out.append(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(p, name)
            if not -2 <= value <= 2:
                out.append(f"{name} must be in [-2, 2], got {value}")
        if p.logprobs is not None and not 0 <= p.logprobs <= self.max_logprobs:
            out.append(f"logprobs must be in [0, {self.max_logprobs}], got {p.logprobs}")
        bad_ids = [i for i in p.stop_token_ids if not 0 <= i < vocab]
        if bad_ids:
            out.append(f"stop_token_ids {bad_ids} are outside the vocabulary [0, {vocab})")
        if any(not isinstance(s, str) or not s for s in p.stop):
            out.append("stop strings must be non-empty strings")
        elif p.stop and self.tokenizer is None:
            out.append("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if request.timeout_s is not None and not request.timeout_s > 0:
            out.append(f"timeout_s must be > 0, got {request.timeout_s}")
        return out

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
            n_virtual=n_virtual, task=self._task_index.get(request.task, -1) if request.task else -1,
            max_new=min(p.max_tokens, self.context - len(tokens)),
            text=OutputText(self.tokenizer, list(request.prompt_ids), p.stop),
            generator=generator, arrival=now,
            deadline=now + request.timeout_s if request.timeout_s else None,
            stop_ids=frozenset(p.stop_token_ids))
        if p.prompt_logprobs:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
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
                if not self._running and not self._waiting:
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
                    for seq in list(self._running):
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
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for seq in list(self._running) + waiting:
            self._finish(seq, "abort", message)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = list(self._aborts), deque()
            for seq in aborts:
                if seq in self._waiting:
                    self._waiting.remove(seq)
        for seq in aborts:
            if not seq.finished:
                seq.aborted = True
                self._finish(seq, "abort")

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [s for s in self._waiting if s.deadline is not None and now > s.deadline]
            for seq in late:
                self._waiting.remove(seq)
        late += [s for s in self._running if s.deadline is not None and now > s.deadline]
        for seq in late:
            self._finish(seq, "timeout")

    def _schedule(self, now: float) -> list[tuple[_Sequence, int]]:
        """This step's rows: (sequence, number of its tokens to run)."""
        budget = self.max_step_tokens
        plan: list[tuple[_Sequence, int]] = []
        for seq in sorted(self._running, key=lambda s: s.n_generated == 0):  # decodes first
            n = min(len(seq.tokens) - seq.cached, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        while budget > 0 and self._free_slots:
            with self._lock:
                seq = self._waiting.popleft() if self._waiting else None
            if seq is None:
                break
            seq.slot = heapq.heappop(self._free_slots)
            self._running.append(seq)
            self._observe("queue_time_seconds", now - seq.arrival)
            n = min(len(seq.tokens), budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _step(self) -> None:
        now = time.monotonic()
        plan = self._schedule(now)
        self._counters["steps_total"] += 1
        to_sample: list[tuple[_Sequence, torch.Tensor]] = []
        done_prefill: list[_Sequence] = []
        # Rows of one token (decodes) and longer prefill chunks run as separate passes, so
        # neither pads to the other's length. Rows in slot order: with the lowest free slot
        # taken first, running slots are usually consecutive and the eager KV cache reads them
        # as a view instead of gathering a copy (a compiled decode step always gathers).
        for group in ([r for r in plan if r[1] == 1], [r for r in plan if r[1] > 1]):
            group.sort(key=lambda row: row[0].slot)
            if group:
                self._run_group(group, to_sample, done_prefill)
        for seq in done_prefill:  # max_tokens 0: prompt scored, nothing to sample
            self._finish(seq, "length")
        if to_sample:
            self._sample_and_advance(to_sample)
        self._kv_tokens = sum(s.cached for s in self._running)

    def _run_group(self, group: list[tuple[_Sequence, int]],
                   to_sample: list[tuple[_Sequence, torch.Tensor]],
                   done_prefill: list[_Sequence]) -> None:
        B, T = len(group), max(n for _, n in group)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        positions = torch.empty((B, T), dtype=torch.long)
        keep: list[int] = []
        wanted: list[tuple[_Sequence, int | None]] = []  # (seq, prompt position or None=sample)
        for r, (seq, n) in enumerate(group):
            start = seq.cached
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
        batch = StepBatch(ids, positions, torch.tensor([s.slot for s, _ in group]),
                          torch.tensor([s.task for s, _ in group]), torch.tensor(keep,
                                                                                 dtype=torch.long))
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
        self._score_prompts(wanted, logits)
        for i, (seq, t) in enumerate(wanted):
            if t is None and not seq.finished:
                if seq.max_new == 0:
                    done_prefill.append(seq)
                else:
                    to_sample.append((seq, logits[i]))

    def _score_prompts(self, wanted: list[tuple[_Sequence, int | None]],
                       logits: torch.Tensor) -> None:
        rows = [i for i, (_, t) in enumerate(wanted) if t is not None]
        if not rows:
            return
        targets = torch.tensor([wanted[i][0].tokens[wanted[i][1] + 1] for i in rows],
                               device=logits.device)
        top = max(wanted[i][0].params.logprobs or 0 for i in rows)
        chosen, values, ids = token_logprobs(logits[rows], targets, top)
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            seq, t = wanted[i]
            k = seq.params.logprobs or 0
            seq.prompt_logprobs[t + 1 - seq.n_virtual] = TokenLogprob(
                int(targets[j]), chosen[j], dict(zip(ids[j][:k], values[j][:k])))

    # ----------------------------------------------------------------- sampling

    def _sample_and_advance(self, rows: list[tuple[_Sequence, torch.Tensor]]) -> None:
        seqs = [s for s, _ in rows]
        logits = torch.stack([row for _, row in rows])
        uniforms = uniforms_from([s.generator for s in seqs])
        try:
            tokens = self._choose(seqs, logits, uniforms).tolist()
        except Exception:
            tokens = []
            for i, seq in enumerate(seqs):  # find the request at fault; the others go on
                try:
                    tokens.append(int(self._choose([seq], logits[i:i + 1], uniforms[i:i + 1])[0]))
                except Exception as exc:
                    log.exception("sampling failed for request %s", seq.request.request_id)
                    tokens.append(None)
                    self._finish(seq, "error", f"sampling failed: {exc}")
        lps = self._sampled_logprobs(seqs, logits, tokens)
        now = time.monotonic()
        for seq, token, lp in zip(seqs, tokens, lps):
            if token is None or seq.finished:
                continue
            try:
                self._advance(seq, token, lp, now)
            except Exception as exc:
                log.exception("request %s failed", seq.request.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _choose(self, seqs: list[_Sequence], logits: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[-1]
        params = [s.params for s in seqs]

        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        settings = RowSettings(column([p.temperature for p in params]),
                               column([max(p.top_k, 0) for p in params], torch.long),
                               column([p.top_p for p in params]),
                               column([p.repetition_penalty for p in params]),
                               column([p.presence_penalty for p in params]),
                               column([p.frequency_penalty for p in params]))
        seen = counts = banned = None
        if any(s.seen is not None for s in seqs):
            seen = torch.stack([s.seen if s.seen is not None else
                                torch.zeros(vocab, dtype=torch.bool, device=device) for s in seqs])
        if any(s.counts is not None for s in seqs):
            counts = torch.stack([s.counts if s.counts is not None else
                                  torch.zeros(vocab, device=device) for s in seqs])
        for i, s in enumerate(seqs):
            if s.n_generated < s.params.min_tokens:
                ban = set(s.stop_ids)
                if self.eos_id is not None and not s.params.ignore_eos:
                    ban.add(self.eos_id)
                if ban:
                    if banned is None:
                        banned = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
                    banned[i, sorted(ban)] = True
        logits = logits.float()
        if seen is not None or counts is not None:
            logits = apply_penalties(logits, settings, seen, counts)
        return choose_tokens(logits, settings, uniforms.to(device), banned)

    def _sampled_logprobs(self, seqs: list[_Sequence], logits: torch.Tensor,
                          tokens: list[int | None]) -> list[TokenLogprob | None]:
        rows = [i for i, s in enumerate(seqs)
                if s.params.logprobs is not None and tokens[i] is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return out
        top = max(seqs[i].params.logprobs for i in rows)
        chosen, values, ids = token_logprobs(
            logits[rows], torch.tensor([tokens[i] for i in rows], device=logits.device), top)
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            k = seqs[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], dict(zip(ids[j][:k], values[j][:k])))
        return out

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
        self._track_penalties(seq, token)
        if (token == self.eos_id and not p.ignore_eos) or token in seq.stop_ids:
            self._finish(seq, "stop")
            return
        if seq.text.add(token, lp, check_stop=seq.n_generated >= p.min_tokens):
            self._finish(seq, "stop")
        elif seq.n_generated >= seq.max_new:
            self._finish(seq, "length")
        else:
            self._emit(seq)

    def _track_penalties(self, seq: _Sequence, token: int) -> None:
        p, vocab = seq.params, self.config.vocab_size
        if p.repetition_penalty != 1.0:
            if seq.seen is None:
                seq.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
                seq.seen[torch.tensor(seq.tokens[seq.n_virtual:seq.n_input])] = True
            seq.seen[token] = True
        if p.presence_penalty or p.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(vocab, device=self.device)
            seq.counts[token] += 1

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
        if seq.slot >= 0:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = -1
        if seq in self._running:
            self._running.remove(seq)
        self._counters[f"requests_finished_{reason}_total"] += 1
        self._kv_tokens = sum(s.cached for s in self._running)
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
