"""What every dialect shares between decoding a request and encoding the answer.

`Service` owns the engine handle, the limits and the metrics. A route decodes its body into
`GenerationRequest`s and calls `Service.start`, which

1. admits them (`max_concurrency` slots; none free: 429 with Retry-After, before any work),
2. validates them with the engine (`RequestError`: 400),
3. submits them and waits until each has produced its first output, so that an engine that is
   full (`Overloaded`: 503) is still answered with a status code rather than mid-stream,

and returns a `Batch`: the merged outputs of those requests, consumed either by `collect`
(non-streaming; a client that hangs up aborts the requests) or by iterating `events` inside an
`EventStream` response (streaming; closing the stream aborts them).

Whatever goes wrong inside one request (engine error, timeout, an exception from the engine
iterator) ends that request with a final output whose `finish_reason` is `"error"` or
`"timeout"`; other requests do not notice. `failure` maps such an ending (and an `"abort"` that
reaches a client still listening, i.e. the engine stopping) to the HTTP error it stands for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tessera.core.chat_template import chat_adds_bos, template_specials
from tessera.serving.http.errors import ApiError
from tessera.serving.http.metrics import ServingMetrics
from tessera.serving.types import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    Overloaded,
    RequestError,
    TokenLogprob,
)

log = logging.getLogger("tessera.serving")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 << 20  # larger bodies: 413
    max_prompt_tokens: int | None = None  # None: whatever fits the engine's context
    max_concurrency: int = 64  # generation requests admitted at once (n > 1 counts n)
    request_timeout_s: float | None = 600.0  # per generation request, queueing included
    retry_after_s: int = 1  # the Retry-After of a 429 / 503
    # Slow clients: a request body chunk late by this long is a 408.
    body_timeout_s: float | None = 30.0


@dataclass
class Result:
    """Everything one `GenerationRequest` produced, accumulated from its outputs."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int = 0

    def add(self, out: GenerationOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens, len(self.token_ids))
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error

    @property
    def failed(self) -> bool:
        return self.finish_reason in FAILURE_STATUS


# A request that ended for one of these reasons did not complete: the HTTP status it stands for.
# ("abort" reaches a client still listening only when the engine is shutting down.)
FAILURE_STATUS = {"error": 500, "abort": 503, "timeout": 504}
_FAILURE_TYPE = {500: "server_error", 503: "overloaded_error", 504: "timeout_error"}


def failure(finish_reason: str | None, error: str | None) -> ApiError | None:
    """The error a finished request stands for, or None if it completed (stop, length)."""
    status = FAILURE_STATUS.get(finish_reason or "")
    if status is None:
        return None
    message = error or {"abort": "the request was aborted", "timeout": "the request timed out"}.get(
        finish_reason, "generation failed")
    return ApiError(status, message, type=_FAILURE_TYPE[status])


def raise_failures(results: list[Result]) -> list[Result]:
    """`results`, or the error of the first request among them that did not complete."""
    for r in results:
        error = failure(r.finish_reason, r.error)
        if error is not None:
            raise error
    return results


def derive_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (choice 0 keeps `seed`)."""
    if seed is None or index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) % 2**63


class Service:
    def __init__(self, engine: Engine, model_name: str, limits: Limits,
                 aliases: tuple[str, ...] = (),
                 sampling_defaults: Mapping[str, float | int] | None = None) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        # The model's own sampling (`core.generation_defaults`) for fields a request leaves out.
        self.sampling_defaults = dict(sampling_defaults or {})
        # Other names the base model answers to (`--served-model-name A B`: B, ...).
        self.base_names = (model_name, *(a for a in aliases if a != model_name))
        self.admitted = 0
        self.metrics = ServingMetrics(engine, model_name, admitted=lambda: self.admitted)

    def sampling_for(self, body: BaseModel) -> dict[str, float | int]:
        """`temperature`, `top_p` and `top_k` as `body` gives them, the model's
        (`sampling_defaults`) for those it leaves out: a request that sets none samples as the
        model's `generation_config.json` says, on every protocol. Values in the protocol's own
        terms (a Megatron `top_p` of 0 is still 0 here)."""
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k")}
        given.update({k: v for k, v in self.sampling_defaults.items()
                      if k not in body.model_fields_set})
        return given

    def chat_specials(self) -> dict[str, str]:
        """`bos_token` / `eos_token` as the chat template renders them for this engine's
        tokenizer (`core.chat_template.template_specials`)."""
        return template_specials(getattr(self.engine, "tokenizer", None))

    def encode_chat(self, text: str) -> list[int]:
        """A rendered conversation's tokens, as transformers' `apply_chat_template` tokenizes it
        (`core.chat_template.encode_chat`): BOS only where the template wrote it, except for a
        sentencepiece tokenizer, which gets it prepended."""
        tokenizer = getattr(self.engine, "tokenizer", None)
        return self.encode(text, add_bos=tokenizer is None or chat_adds_bos(tokenizer))

    # ------------------------------------------------------------------ decoding helpers

    def task_of(self, model: str | None) -> str | None:
        """The task that model name `BASE` (None) or `BASE:TASK` selects; 404 otherwise."""
        if model is None or model in self.base_names:
            return None
        base, sep, task = model.partition(":")
        if base not in self.base_names or not sep:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_names()}", param="model", code="model_not_found")
        self.check_task(task)
        return task

    def choose(self, model: str | None) -> tuple[str | None, str | None]:
        """(task, LoRA adapter) that model name `BASE` (None), `BASE:TASK`, `BASE:ADAPTER` or an
        adapter's own name selects; 404 in the caller's dialect otherwise."""
        adapters = self.adapter_names()
        if model is not None and model in adapters and model not in self.base_names:
            return None, model
        base, sep, rest = (model or "").partition(":")
        if sep and base in self.base_names and rest in adapters:
            return None, rest
        return self.task_of(model), None

    def adapter_names(self) -> list[str]:
        """The LoRA adapters the engine serves now (engines without adapters: none)."""
        names = getattr(self.engine, "adapter_names", None)
        return list(names()) if names is not None else []

    def check_adapter(self, adapter: str | None) -> str | None:
        """`adapter`, or a 404 when no adapter of that name is loaded."""
        if adapter is not None and adapter not in self.adapter_names():
            loaded = self.adapter_names()
            raise ApiError(404, f"no LoRA adapter named {adapter!r} is loaded; loaded: "
                                f"{loaded if loaded else 'none'}", param="adapter",
                           code="model_not_found")
        return adapter

    def check_task(self, task: str) -> None:
        if task not in self.engine.tasks():
            tasks = self.engine.tasks()
            raise ApiError(404, f"unknown task {task!r}; this model serves "
                                f"{tasks if tasks else 'no prompt-tuned tasks'}",
                           param="model", code="model_not_found")

    @property
    def bos_ids(self) -> list[int]:
        """What `encode` puts before a text prompt's tokens (BOS, or nothing)."""
        if not hasattr(self, "_bos_ids"):
            try:
                self._bos_ids = self.engine.encode("", add_bos=True)
            except RequestError:  # no tokenizer
                self._bos_ids = []
        return self._bos_ids

    def model_names(self) -> list[str]:
        return ([self.model_name] + [f"{self.model_name}:{t}" for t in self.engine.tasks()]
                + self.adapter_names())

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = self.engine.encode(text, add_bos=add_bos)
        except RequestError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        return self.check_prompt(ids)

    @property
    def vocab_size(self) -> int | None:
        """The engine's vocabulary size (None if it does not say)."""
        config = getattr(self.engine, "config", None)
        return getattr(config, "vocab_size", None) or getattr(self.engine, "vocab_size", None)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """`ids`, or a 400 naming the first id outside the vocabulary (before anything decodes
        them: a negative or huge id is the client's error, never a 500)."""
        vocab = self.vocab_size
        limit = vocab if vocab is not None else 2**63
        bad = next((i for i in ids if not 0 <= i < limit), None)
        if bad is not None:
            shown = str(bad) if abs(bad) < 10**20 else f"{str(bad)[:12]}... ({len(str(bad))} digits)"
            where = f"the vocabulary [0, {vocab})" if vocab is not None else "[0, 2**63)"
            raise ApiError(400, f"{param}: token id {shown} is outside {where}", param=param,
                           code="invalid_token_id")
        return ids

    def check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        self.check_token_ids(ids)
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                                f"{limit}", param="prompt", code="prompt_too_long")
        return ids

    def check_capacity(self, dialect: str) -> None:
        """429 now if no admission slot is free (called before the body is even read)."""
        if self.admitted >= self.limits.max_concurrency:
            self.metrics.request(dialect, "rejected")
            raise self._busy(429, f"the server is at its limit of {self.limits.max_concurrency} "
                                  "concurrent requests; retry later")

    def _busy(self, status: int, message: str) -> ApiError:
        kind = "rate_limit_error" if status == 429 else "overloaded_error"
        return ApiError(status, message, type=kind, code="overloaded",
                        headers={"Retry-After": str(self.limits.retry_after_s)})

    # -------------------------------------------------------------------------- running

    async def start(self, requests: list[GenerationRequest], dialect: str,
                    http: Request | None = None) -> Batch:
        """Admit, validate and submit `requests`; see the module docstring. If the client of
        `http` hangs up while the requests wait for their first output, they are aborted."""
        n, cap = len(requests), self.limits.max_concurrency
        # A refused HTTP request counts once, however many generations it asked for.
        if n > cap:
            self.metrics.request(dialect, "invalid")
            raise ApiError(400, f"the request asks for {n} generations; this server runs at "
                                f"most {cap} at once", param="n")
        context = self.engine.max_context()
        for request in requests:
            if request.timeout_s is None:
                request.timeout_s = self.limits.request_timeout_s
            prompt, wanted = len(request.prompt_ids), request.params.max_tokens
            try:
                if prompt + wanted > context:
                    raise RequestError(
                        f"max_tokens {wanted} does not fit: the context is {context} tokens and "
                        f"the prompt has {prompt}, so at most {max(context - prompt, 0)} tokens "
                        "can be generated")
                self.engine.validate(request)
            except RequestError as exc:
                self.metrics.request(dialect, "invalid")
                raise ApiError(400, str(exc), param="max_tokens" if prompt + wanted > context
                               else None) from None
        if self.admitted + n > cap:
            self.metrics.request(dialect, "rejected")
            raise self._busy(429, f"the server is at its limit of {cap} concurrent requests; "
                                  "retry later")
        self.admitted += n
        batch = Batch(self, requests, dialect)
        try:
            await (batch.prime() if http is None else _unless_disconnected(http, batch.prime()))
        except BaseException:
            await batch.aclose()
            raise
        return batch


class Batch:
    """The running requests of one HTTP request (n choices, several prompts, a tensor batch)."""

    def __init__(self, service: Service, requests: list[GenerationRequest], dialect: str) -> None:
        self.service, self.dialect = service, dialect
        self.results = [Result(list(r.prompt_ids)) for r in requests]
        self._queue: asyncio.Queue[tuple[int, GenerationOutput | Exception]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(requests)]
        self._buffer: list[tuple[int, GenerationOutput]] = []
        self._unfinished = len(requests)
        self._released = False

    async def prime(self) -> None:
        """Wait for every request's first output; raise a 503 / 400 if the engine refused one."""
        waiting = set(range(len(self.results)))
        while waiting:
            i, item = await self._queue.get()
            if isinstance(item, Overloaded):
                self.service.metrics.request(self.dialect, "rejected")
                raise self.service._busy(503, f"the engine is overloaded ({item}); retry later")
            if isinstance(item, RequestError):
                self.service.metrics.request(self.dialect, "invalid")
                raise ApiError(400, str(item))
            self._buffer.append((i, item))
            waiting.discard(i)

    async def events(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """(index, output) in arrival order, until every request has finished."""
        while self._buffer or self._unfinished:
            i, out = self._buffer.pop(0) if self._buffer else await self._queue.get()
            self.results[i].add(out)
            if out.finished:
                self._unfinished -= 1
            yield i, out

    async def collect(self, request: Request | None = None) -> list[Result]:
        """Run every request to its end; if `request`'s client hangs up first, abort them."""
        async def drain() -> None:
            async for _ in self.events():
                pass

        try:
            if request is None:
                await drain()
            else:
                await _unless_disconnected(request, drain())
        finally:
            await self.aclose()
        return self.results

    async def aclose(self) -> None:
        """Abort what is still running (closing the engine iterators) and free the slots."""
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if not self._released:
                self._released = True
                self.service.admitted -= len(self.results)

    async def _pump(self, i: int, request: GenerationRequest) -> None:
        """Move request `i`'s outputs to the queue; end it with exactly one finished output."""
        metrics, engine = self.service.metrics, self.service.engine
        submitted = last = time.perf_counter()
        produced = finished = False
        iterator = None
        timeout = request.timeout_s
        try:
            # The server's own deadline, a little after the engine's, in case the engine stalls.
            with anyio.fail_after(timeout * 1.05 + 1.0) if timeout else nullcontext():
                iterator = aiter(engine.generate(request))
                async for out in iterator:
                    now = time.perf_counter()
                    if out.token_ids:
                        (metrics.itl if produced else metrics.ttft).observe(now - last)
                        produced, last = True, now
                    if out.finished:
                        finished = True
                        self._record_finish(request, out, submitted)
                    self._queue.put_nowait((i, out))
                    if finished:
                        return
            message = "the engine ended the request's stream without finishing it"
            self._fail(i, request, submitted, "error", message)
        except (Overloaded, RequestError) as exc:
            if produced:
                self._fail(i, request, submitted, "error", str(exc))
            else:
                self._queue.put_nowait((i, exc))
        except TimeoutError:
            self._fail(i, request, submitted, "timeout", f"the request timed out after {timeout:g} s")
        except asyncio.CancelledError:
            if not finished:
                metrics.request(self.dialect, "abort")
            raise
        except Exception as exc:
            log.exception("request %s failed in the engine", request.request_id)
            self._fail(i, request, submitted, "error", f"{type(exc).__name__}: {exc}")
        finally:
            if iterator is not None and hasattr(iterator, "aclose"):
                with anyio.CancelScope(shield=True):
                    try:
                        await iterator.aclose()
                    except Exception:
                        log.exception("closing the engine stream of %s failed", request.request_id)

    def _record_finish(self, request: GenerationRequest, out: GenerationOutput, submitted: float) -> None:
        metrics = self.service.metrics
        metrics.e2e.observe(time.perf_counter() - submitted)
        metrics.prompt_tokens.inc(out.prompt_tokens or len(request.prompt_ids))
        metrics.generation_tokens.inc(out.completion_tokens)
        metrics.request(self.dialect, out.finish_reason or "stop")
        # A LoRA adapter (when the engine serves them) or a prompt-tuned task selects the model.
        metrics.finished(getattr(request, "adapter", None) or request.task)

    def _fail(self, i: int, request: GenerationRequest, submitted: float, reason: str, message: str) -> None:
        done = self.results[i]
        out = GenerationOutput(request.request_id, [], "", finished=True, finish_reason=reason,  # type: ignore[arg-type]
                               prompt_tokens=len(request.prompt_ids),
                               completion_tokens=done.completion_tokens, error=message)
        self._record_finish(request, out, submitted)
        self._queue.put_nowait((i, out))


async def _unless_disconnected(request: Request, work) -> None:
    """Await `work`; cancel it (and raise `ClientGone`) if the client disconnects first."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not job.done():
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        raise ApiError(499, "the client closed the request")
    job.result()


class EventStream(StreamingResponse):
    """Server-sent events that stop (closing the event iterator) when the client goes away.

    Starlette only notices a disconnect on the next write under newer ASGI servers; a request
    still waiting in the engine queue writes nothing, so this always listens for it.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except Exception as exc:  # anyio wraps what the tasks raised in an exception group
            if not _socket_closed(exc):
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _socket_closed(exc: BaseException) -> bool:
    """`exc` is (a group of only) OSErrors: the client's socket closed under a write."""
    inner = getattr(exc, "exceptions", None)
    return isinstance(exc, OSError) or bool(inner) and all(_socket_closed(e) for e in inner)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def json_logprob(x: float) -> float:
    """A logprob fit for JSON, which cannot hold -inf: impossible tokens get -9999."""
    return x if math.isfinite(x) else -9999.0
