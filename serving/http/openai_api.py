"""The OpenAI dialect: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each route is `decode` (body -> `Plan`: engine requests plus what the answer needs) ->
`Service.start` -> `encode` (results -> OpenAI JSON, or SSE chunks ending in `data: [DONE]`).

- `model` is `BASE` or `BASE:TASK` (a prompt-tuned task); anything else is a 404.
- `n` > 1 runs n engine requests; choice i of a seeded request uses `derive_seed(seed, i)`.
  With several prompts, choice `p * n + i` is prompt p's i-th.
- Streams end with each choice's `finish_reason` chunk, then the usage-only chunk
  (`choices: []`) when `stream_options.include_usage` asks for it, then `data: [DONE]`. An error
  inside a request arrives as a `data: {"error": {...}}` event (the status is already 200).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera.core.chat_template import ChatTemplate as CoreChatTemplate
from tessera.core.chat_template import ChatTemplateError
from tessera.serving.http import schemas as S
from tessera.serving.http.errors import ApiError, body_doc, openai_error_body, parse_body
from tessera.serving.http.security import read_body
from tessera.serving.http.service import (
    Batch,
    EventStream,
    Result,
    Service,
    derive_seed,
    failure,
    json_logprob,
    raise_failures,
    sse,
)
from tessera.serving.http.structured import structured_output
from tessera.serving.http.token_text import TokenTexts, fit_to, key_bytes, prompt_texts
from tessera.serving.http.tool_calls import (
    FORMATS,
    ToolCallStream,
    forced_call,
    format_of,
    parse_tool_calls,
    template_messages,
    template_tools,
)
from tessera.serving.types import GenerationRequest, SamplingParams, TokenLogprob

router = APIRouter(tags=["OpenAI"])


class ChatTemplate(CoreChatTemplate):
    """The core chat template over the request's `ChatMessage`s (and `tools`); a failure is a
    400. `tool_format` is the tool-call format the template writes (`serving.http.tool_calls`),
    None if it has none."""

    def __init__(self, source: str | None = None) -> None:
        super().__init__(source)
        self.tool_format = format_of(self.source)

    def render(self, messages: list[S.ChatMessage],  # type: ignore[override]
               tools: list[S.Tool] | None = None, **specials: str) -> str:
        """The conversation as text; `specials`: `bos_token` / `eos_token` spellings
        (`Service.chat_specials`)."""
        try:
            turns = template_messages(messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        try:
            return super().render(turns, tools=template_tools(tools) if tools else None,
                                  **specials)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None


@dataclass
class Plan:
    """What a decoded OpenAI request runs, and what its answer needs to know."""

    id: str
    model: str
    chat: bool
    requests: list[GenerationRequest]
    prompt_texts: list[str]  # per prompt
    n: int
    stream: bool
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per position; None: no logprobs
    echo: bool = False
    created: int = 0
    tool_format: str | None = None  # chat with tools: the format its output is parsed in

    def prompt_of(self, choice: int) -> int:
        return choice // self.n


def _service(request: Request) -> Service:
    return request.app.state.service


# ------------------------------------------------------------------------------------ routes


@router.get("/v1/models", response_model=S.ModelList)
async def list_models(request: Request) -> S.ModelList:
    service = _service(request)
    base, created = service.model_name, int(request.app.state.started)
    context = service.engine.max_context()
    return S.ModelList(data=[
        S.ModelCard(id=name, created=created, root=base, parent=None if name == base else base,
                    max_model_len=context)
        for name in service.model_names()])


@router.post("/v1/completions", response_model=S.CompletionResponse,
             openapi_extra=body_doc(S.CompletionRequest))
async def completions(request: Request) -> Response:
    service = _service(request)
    service.check_capacity("openai")
    body = parse_body(await read_body(request), S.CompletionRequest)
    return await _run(request, service, decode_completion(service, body))


@router.post("/v1/chat/completions", response_model=S.ChatCompletionResponse,
             openapi_extra=body_doc(S.ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    service = _service(request)
    service.check_capacity("openai")
    body = parse_body(await read_body(request), S.ChatCompletionRequest)
    return await _run(request, service, decode_chat(service, body, request.app.state.chat_template))


async def _run(request: Request, service: Service, plan: Plan) -> Response:
    batch = await service.start(plan.requests, "openai", request)
    if plan.stream:
        return EventStream(stream_events(service, plan, batch))
    results = raise_failures(await batch.collect(request))
    body = encode_chat(service, plan, results) if plan.chat else encode_completion(service, plan, results)
    return JSONResponse(body.model_dump(exclude_none=False))


# ---------------------------------------------------------------------------------- decoding


def _sampling(body: S.SamplingFields, max_tokens: int,
              defaults: Mapping[str, float | int] | None = None, **extra) -> SamplingParams:
    """The request's sampling; `defaults` (the model's) fill the fields the body leaves out."""
    given = {"temperature": body.temperature, "top_k": max(body.top_k, 0), "top_p": body.top_p}
    given.update({k: v for k, v in (defaults or {}).items() if k not in body.model_fields_set})
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=body.min_tokens, **given, seed=body.seed,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, **extra)


def _requests(service: Service, prompts: list[list[int]], body: S.SamplingFields,
              max_tokens: int | None, plan_id: str, task: str | None,
              adapter: str | None = None, **extra) -> list[GenerationRequest]:
    room = service.engine.max_context()
    requests = []
    for p, ids in enumerate(prompts):
        budget = max(room - len(ids), 0) if max_tokens is None else max_tokens
        for i in range(body.n):
            params = _sampling(body, budget, service.sampling_defaults, **extra)
            params.seed = derive_seed(body.seed, i)
            requests.append(GenerationRequest(f"{plan_id}-{p * body.n + i}", ids, params, task,
                                              priority=body.priority, cache_salt=body.cache_salt,
                                              adapter=adapter))
    return requests


def decode_completion(service: Service, body: S.CompletionRequest) -> Plan:
    task, adapter = service.choose(body.model)
    service.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    prompts = [service.encode(p) if isinstance(p, str) else service.check_prompt(list(p)) for p in raw]
    texts = [p if isinstance(p, str) else service.engine.decode(ids) for p, ids in zip(raw, prompts)]
    plan_id = f"cmpl-{uuid.uuid4().hex}"
    extra = {"logprobs": body.logprobs, "prompt_logprobs": body.echo and body.logprobs is not None,
             "structured": structured_output(body)}
    return Plan(plan_id, body.model or service.model_name, False,
                _requests(service, prompts, body, body.max_tokens, plan_id, task, adapter,
                          **extra),
                texts, body.n, body.stream, _include_usage(body), body.logprobs, body.echo,
                int(time.time()))


def decode_chat(service: Service, body: S.ChatCompletionRequest, template: ChatTemplate) -> Plan:
    task, adapter = service.choose(body.model)
    service.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
    structured = structured_output(body)
    choice = body.tool_choice or ("auto" if body.tools else "none")
    tools = body.tools if choice != "none" else None
    if tools and template.tool_format is None:
        raise ApiError(400, "this server's chat template has no tool-call format (one of "
                            f"{', '.join(FORMATS)}: Llama 3.x JSON, Qwen2.5 <tool_call>, Mistral "
                            "[TOOL_CALLS]); serve a tool-calling template with --chat-template",
                       param="tools")
    if tools and choice != "auto":  # required or a named function: the grammar forces a call
        if structured is not None:
            raise ApiError(400, "tool_choice 'required' or a named function already constrains "
                                "the output: drop response_format / guided_*", param="tool_choice")
        structured = forced_call(template.tool_format, tools, choice)
    text = template.render(body.messages, tools, **service.chat_specials())
    ids = service.encode_chat(text)
    plan_id = f"chatcmpl-{uuid.uuid4().hex}"
    k = (body.top_logprobs or 0) if body.logprobs else None
    return Plan(plan_id, body.model or service.model_name, True,
                _requests(service, [ids], body, body.token_budget, plan_id, task, adapter,
                          logprobs=k, structured=structured),
                [text], body.n, body.stream, _include_usage(body), k, False, int(time.time()),
                tool_format=template.tool_format if tools else None)


def _include_usage(body: S.SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---------------------------------------------------------------------------------- encoding


def _usage(plan: Plan, results: list[Result]) -> S.Usage:
    prompt = sum(len(plan.requests[p * plan.n].prompt_ids) for p in range(len(plan.prompt_texts)))
    completion = sum(r.completion_tokens for r in results)
    return S.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _top(texts: TokenTexts, entry: TokenLogprob, k: int) -> dict[str, float]:
    """The top-k alternatives at a position as {key: logprob} (`TokenTexts.key`), and the
    chosen token always (so `logprobs: 0` gives it alone, never null)."""
    out: dict[str, float] = {}
    for token_id, lp in [*_best(entry.top, k), (entry.token_id, entry.logprob)]:
        key, value = texts.key(token_id), json_logprob(lp)
        out[key] = max(out.get(key, value), value)
    return out


def completion_logprobs(entries: list[TokenLogprob | None], ids: list[int], k: int,
                        texts: TokenTexts, offset: int = 0, final: bool = True,
                        target: str | None = None) -> S.CompletionLogprobs:
    """The legacy `logprobs` object of `ids`, continuing the sequence `texts` has seen; the
    tokens concatenate to the text (cut to `target`, the text these ids produced, when a stop
    string ended inside them)."""
    out = S.CompletionLogprobs(top_logprobs=[])
    tokens: list[str] = []
    for token_id, entry in zip(ids, entries):
        out.token_logprobs.append(None if entry is None else json_logprob(entry.logprob))
        out.top_logprobs.append(None if entry is None else _top(texts, entry, k))
        tokens += texts.push(token_id)
    tokens += texts.end(final)
    out.tokens = tokens if target is None else fit_to(tokens, target)
    for token in out.tokens:
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _best(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(entries: list[TokenLogprob], k: int, texts: TokenTexts, final: bool = True,
                  target: str | None = None) -> S.ChatLogprobs:
    """The chat `logprobs.content` of `entries`: token texts (and their UTF-8 `bytes`) that
    concatenate to the message, each with its top-k alternatives."""
    tops, tokens = [], []
    for e in entries:
        tops.append(list(_top(texts, e, k).items()) if k else [])
        tokens += texts.push(e.token_id)
    tokens += texts.end(final)
    if target is not None:
        tokens = fit_to(tokens, target)

    def item(token: str, lp: float) -> dict:
        return {"token": token, "logprob": json_logprob(lp), "bytes": key_bytes(token)}

    return S.ChatLogprobs(content=[
        S.ChatTokenLogprob(**item(token, e.logprob),
                           top_logprobs=[S.TopLogprob(**item(t, lp)) for t, lp in top])
        for token, e, top in zip(tokens, entries, tops)])


def _echo_prefix(service: Service, plan: Plan, choice: int,
                 result: Result) -> tuple[str, S.CompletionLogprobs | None]:
    """The prompt part of an echoed choice: its text, and its logprobs when asked for."""
    text = plan.prompt_texts[plan.prompt_of(choice)]
    if plan.logprobs is None:
        return text, None
    ids = result.prompt_ids
    entries = result.prompt_logprobs or [None] * len(ids)
    out = S.CompletionLogprobs(top_logprobs=[])
    out.tokens = prompt_texts(service.engine.decode, ids, service.bos_ids)
    offset = 0
    for token, entry in zip(out.tokens, entries):
        out.token_logprobs.append(None if entry is None else json_logprob(entry.logprob))
        out.text_offset.append(offset)
        offset += len(token)
    # The alternatives at position i are scored after tokens [0, i): a fresh pass in context.
    texts = TokenTexts.of(service.engine)
    for token_id, entry in zip(ids, entries):
        out.top_logprobs.append(None if entry is None else _top(texts, entry, plan.logprobs))
        texts.push(token_id)
    return text, out


def _generated_texts(service: Service, result: Result) -> TokenTexts:
    """Token texts continuing `result`'s prompt."""
    return TokenTexts.of(service.engine, result.prompt_ids)


def encode_completion(service: Service, plan: Plan, results: list[Result]) -> S.CompletionResponse:
    choices = []
    for i, r in enumerate(results):
        text, logprobs = r.text, None
        if plan.logprobs is not None:
            logprobs = completion_logprobs(r.logprobs, r.token_ids, plan.logprobs,
                                           _generated_texts(service, r), target=r.text)
        if plan.echo:
            prefix, prompt_lp = _echo_prefix(service, plan, i, r)
            text = prefix + text
            if prompt_lp is not None and logprobs is not None:
                logprobs = _join(prompt_lp, logprobs)
        choices.append(S.CompletionChoice(index=i, text=text, logprobs=logprobs,
                                          finish_reason=r.finish_reason))
    return S.CompletionResponse(id=plan.id, created=plan.created, model=plan.model, choices=choices,
                                usage=_usage(plan, results))


def _join(a: S.CompletionLogprobs, b: S.CompletionLogprobs) -> S.CompletionLogprobs:
    shift = (a.text_offset[-1] + len(a.tokens[-1])) if a.tokens else 0
    return S.CompletionLogprobs(tokens=a.tokens + b.tokens,
                                token_logprobs=a.token_logprobs + b.token_logprobs,
                                top_logprobs=(a.top_logprobs or []) + (b.top_logprobs or []),
                                text_offset=a.text_offset + [o + shift for o in b.text_offset])


def _message(plan: Plan, result: Result) -> tuple[S.AssistantMessage, str | None]:
    """A choice's message (its tool calls parsed out when tools were offered) and its
    finish reason ("tool_calls" when it called)."""
    if plan.tool_format is None:
        return S.AssistantMessage(content=result.text), result.finish_reason
    content, calls = parse_tool_calls(plan.tool_format, result.text)
    if not calls:
        return S.AssistantMessage(content=result.text), result.finish_reason
    reason = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
    return S.AssistantMessage(content=content, tool_calls=calls), reason


def encode_chat(service: Service, plan: Plan, results: list[Result]) -> S.ChatCompletionResponse:
    k = plan.logprobs
    choices = []
    for i, r in enumerate(results):
        message, reason = _message(plan, r)
        choices.append(S.ChatChoice(
            index=i, message=message, finish_reason=reason,
            logprobs=None if k is None else chat_logprobs(
                r.logprobs, k, _generated_texts(service, r), target=r.text)))
    return S.ChatCompletionResponse(id=plan.id, created=plan.created, model=plan.model,
                                    choices=choices, usage=_usage(plan, results))


async def stream_events(service: Service, plan: Plan, batch: Batch) -> AsyncIterator[str]:
    """The SSE body of a streaming request; closing it aborts the requests still running."""
    head = {"id": plan.id, "created": plan.created, "model": plan.model,
            "object": "chat.completion.chunk" if plan.chat else "text_completion"}
    started: set[int] = set()
    offsets = [0] * len(plan.requests)
    texts: dict[int, TokenTexts] = {}
    calls = ({i: ToolCallStream(plan.tool_format) for i in range(len(plan.requests))}
             if plan.tool_format else {})

    def chunk(choice: dict) -> str:
        return sse(json.dumps({**head, "choices": [choice]}))

    try:
        async for i, out in batch.events():
            error = failure(out.finish_reason, out.error)
            if error is not None:
                yield sse(json.dumps(openai_error_body(error.status, error.message, type=error.type)))
                continue
            text, logprobs = out.text, None
            if i not in started:
                started.add(i)
                if plan.chat:
                    yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                elif plan.echo:
                    prefix, prompt_lp = _echo_prefix(service, plan, i, batch.results[i])
                    offsets[i] = len(prefix)
                    yield chunk({"index": i, "text": prefix, "finish_reason": None,
                                 "logprobs": prompt_lp and prompt_lp.model_dump()})
            if plan.logprobs is not None and out.logprobs:
                if i not in texts:
                    texts[i] = _generated_texts(service, batch.results[i])
                if plan.chat:
                    logprobs = chat_logprobs(out.logprobs, plan.logprobs, texts[i], out.finished,
                                             text).model_dump()
                else:
                    lp = completion_logprobs(out.logprobs, out.token_ids, plan.logprobs, texts[i],
                                             offsets[i], out.finished, text)
                    offsets[i] += sum(len(t) for t in lp.tokens)
                    logprobs = lp.model_dump()
            if not (text or logprobs or out.finished):
                continue
            reason = out.finish_reason if out.finished else None
            if plan.chat and i in calls:  # content until a call may begin; calls at the end
                text = calls[i].feed(text)
                if out.finished:
                    rest, deltas = calls[i].finish()
                    text += rest
                    if deltas:
                        if text or logprobs:
                            yield chunk({"index": i, "delta": {"content": text},
                                         "logprobs": logprobs, "finish_reason": None})
                            text, logprobs = "", None
                        for delta in deltas:
                            yield chunk({"index": i, "delta": {"tool_calls": [delta]},
                                         "logprobs": None, "finish_reason": None})
                        if reason == "stop":
                            reason = "tool_calls"
                        yield chunk({"index": i, "delta": {}, "logprobs": None,
                                     "finish_reason": reason})
                        continue
                if not (text or logprobs or out.finished):
                    continue
            if plan.chat:
                yield chunk({"index": i, "delta": {"content": text}, "logprobs": logprobs,
                             "finish_reason": reason})
            else:
                yield chunk({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
        if plan.include_usage:
            usage = _usage(plan, batch.results).model_dump()
            yield sse(json.dumps({**head, "choices": [], "usage": usage}))
        yield sse("[DONE]")
    finally:
        await batch.aclose()
