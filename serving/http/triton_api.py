"""The KServe v2 / Triton dialect, so NVIDIA's `tritonclient` (sync and aio) works unchanged.

The served model takes the TensorRT-LLM `ensemble` inputs (`TritonInputs`: `text_input`,
`max_tokens`, `temperature`, `top_k`, `top_p`, `random_seed`, `stop_words`,
`return_log_probs`, `task` / `task_id`, ...) and returns `text_output`, plus `cum_log_probs`
and `output_log_probs` when asked. It answers to its own name, to `ensemble` (so TRT-LLM
client scripts and benchmarks run as they are), to `NAME:TASK` for each prompt-tuned task, and
to `NAME:ADAPTER` (or the adapter's own name) for each loaded LoRA adapter (or give the
`adapter` input).

Routes: server metadata and health, model metadata / ready / config (with or without
`versions/1`), the repository index, `infer` (JSON and binary tensors, `triton_codec`), and
the generate extension (`generate`, `generate_stream` as SSE with no end sentinel). Errors are
`{"error": "message"}`; health is answered by status code alone. Bodies are read raw, never
through a pydantic body parameter: the sync client sends no Content-Type at all.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera.serving.http import schemas as S
from tessera.serving.http.errors import ApiError, body_doc, decode_json, validate
from tessera.serving.http.security import read_body
from tessera.serving.http.service import (
    Batch,
    EventStream,
    Result,
    Service,
    failure,
    json_logprob,
    raise_failures,
    sse,
)
from tessera.serving.http.structured import structured_from_field
from tessera.serving.http.triton_codec import decode_request, encode_response
from tessera.serving.http.version import SERVER_VERSION
from tessera.serving.types import GenerationRequest, SamplingParams

router = APIRouter(tags=["KServe v2 / Triton"])

ALIAS = "ensemble"
VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "parameters",
              "generate"]
# (name, datatype, Triton config type, dims without the batch dimension, optional)
INPUTS = [
    ("text_input", "BYTES", "TYPE_STRING", [1], False),
    ("max_tokens", "INT32", "TYPE_INT32", [1], True),
    ("min_length", "INT32", "TYPE_INT32", [1], True),
    ("temperature", "FP32", "TYPE_FP32", [1], True),
    ("top_k", "INT32", "TYPE_INT32", [1], True),
    ("top_p", "FP32", "TYPE_FP32", [1], True),
    ("random_seed", "UINT64", "TYPE_UINT64", [1], True),
    ("repetition_penalty", "FP32", "TYPE_FP32", [1], True),
    ("presence_penalty", "FP32", "TYPE_FP32", [1], True),
    ("frequency_penalty", "FP32", "TYPE_FP32", [1], True),
    ("stop_words", "BYTES", "TYPE_STRING", [-1], True),
    ("return_log_probs", "BOOL", "TYPE_BOOL", [1], True),
    ("task", "BYTES", "TYPE_STRING", [1], True),
    ("task_id", "INT32", "TYPE_INT32", [1], True),
    ("stream", "BOOL", "TYPE_BOOL", [1], True),
    ("adapter", "BYTES", "TYPE_STRING", [1], True),
    ("priority", "INT32", "TYPE_INT32", [1], True),
    ("cache_salt", "BYTES", "TYPE_STRING", [1], True),
]
OUTPUTS = [
    ("text_output", "BYTES", "TYPE_STRING", [1]),
    ("cum_log_probs", "FP32", "TYPE_FP32", [1]),
    ("output_log_probs", "FP32", "TYPE_FP32", [-1]),
]
LOGPROB_OUTPUTS = ("cum_log_probs", "output_log_probs")


def _service(request: Request) -> Service:
    return request.app.state.service


def _resolve(service: Service, model: str, version: str | None) -> str | None:
    """The task the model name selects (None: the base model); 404 for anything unknown."""
    return _choose(service, model, version)[0]


def _choose(service: Service, model: str, version: str | None) -> tuple[str | None, str | None]:
    """(task, LoRA adapter) the model name selects: BASE, `ensemble`, BASE:TASK, BASE:ADAPTER
    or an adapter's own name; 404 for anything unknown."""
    if version is not None and version != VERSION:
        raise ApiError(404, f"model {model!r} has no version {version!r}; its only version is {VERSION}")
    if model in (*service.base_names, ALIAS):
        return None, None
    adapters = service.adapter_names()
    if model in adapters:
        return None, model
    base, sep, rest = model.partition(":")
    if base in (*service.base_names, ALIAS) and sep and rest in service.engine.tasks():
        return rest, None
    if base in (*service.base_names, ALIAS) and sep and rest in adapters:
        return None, rest
    raise ApiError(404, f"unknown model {model!r}; this server serves {_names(service)}")


def _names(service: Service) -> list[str]:
    return ([service.model_name, ALIAS]
            + [f"{service.model_name}:{t}" for t in service.engine.tasks()]
            + [f"{service.model_name}:{a}" for a in service.adapter_names()])


def _both(path: str, **kwargs: Any):
    """Register a route at `/v2/models/{model}PATH` and `/v2/models/{model}/versions/{version}PATH`."""
    def register(func):
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            router.add_api_route(prefix + path, func, **kwargs)
        return func
    return register


# ---------------------------------------------------------------------- metadata, health


@router.get("/v2")
async def server_metadata() -> dict:
    return {"name": "tessera", "version": SERVER_VERSION, "extensions": EXTENSIONS}


@router.get("/v2/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    alive = getattr(_service(request).engine, "alive", True)
    return Response(status_code=200 if alive else 503)


@_both("/ready", methods=["GET"])
async def model_ready(request: Request, model: str, version: str | None = None) -> Response:
    try:
        _resolve(_service(request), model, version)
    except ApiError:
        return Response(status_code=400)
    return Response(status_code=200)


@_both("", methods=["GET"])
async def model_metadata(request: Request, model: str, version: str | None = None) -> dict:
    _resolve(_service(request), model, version)
    return {"name": model, "versions": [VERSION], "platform": "tessera",
            "inputs": [{"name": n, "datatype": d, "shape": [-1, *dims]} for n, d, _, dims, _ in INPUTS],
            "outputs": [{"name": n, "datatype": d, "shape": [-1, *dims]} for n, d, _, dims in OUTPUTS]}


@_both("/config", methods=["GET"])
async def model_config(request: Request, model: str, version: str | None = None) -> dict:
    service = _service(request)
    _resolve(service, model, version)
    return {
        "name": model, "platform": "tessera", "backend": "tessera",
        "max_batch_size": service.limits.max_concurrency,
        "input": [{"name": n, "data_type": t, "dims": dims, "optional": opt}
                  for n, _, t, dims, opt in INPUTS],
        "output": [{"name": n, "data_type": t, "dims": dims} for n, _, t, dims in OUTPUTS],
        "version_policy": {"specific": {"versions": [VERSION]}},
        "model_transaction_policy": {"decoupled": False},
        "parameters": {"max_context": {"string_value": str(service.engine.max_context())}},
    }


@router.post("/v2/repository/index")
async def repository_index(request: Request) -> list[dict]:
    return [{"name": name, "version": VERSION, "state": "READY"} for name in _names(_service(request))]


# --------------------------------------------------------------------------------- infer


def _scalar(value: Any, name: str) -> Any:
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"input {name!r} is not valid UTF-8 (byte {exc.start})") from None
    return value.item() if isinstance(value, np.generic) else value


def _rows(tensors: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One `TritonInputs`-shaped dict per batch row; inputs of one element apply to every row."""
    if "text_input" not in tensors:
        raise ApiError(400, "the request has no 'text_input' input")
    batch = tensors["text_input"].size
    if batch == 0:
        raise ApiError(400, "text_input is empty")
    rows: list[dict[str, Any]] = [{} for _ in range(batch)]
    for name, array in tensors.items():
        if name == "stop_words":
            per_row = array.ndim >= 2 and array.shape[0] == batch
            for i, row in enumerate(rows):
                words = array[i] if per_row else array
                row[name] = [w for w in (_scalar(x, name) for x in words.ravel()) if w]
            continue
        flat = array.ravel()
        if flat.size not in (1, batch):
            raise ApiError(400, f"input {name!r} has {flat.size} elements for a batch of {batch}")
        for i, row in enumerate(rows):
            row[name] = _scalar(flat[i if flat.size == batch else 0], name)
    return rows


def to_request(service: Service, inputs: S.TritonInputs, task: str | None, request_id: str,
               logprobs: bool = False, adapter: str | None = None) -> GenerationRequest:
    """The engine request for one row of validated inputs (`adapter`: from the URL; the
    `adapter` input overrides it)."""
    if inputs.task is not None:
        service.check_task(inputs.task)
        task = inputs.task
    elif isinstance(inputs.task_id, str):
        service.check_task(inputs.task_id)
        task = inputs.task_id
    elif isinstance(inputs.task_id, int):
        tasks = service.engine.tasks()
        if not 0 <= inputs.task_id < len(tasks):
            raise ApiError(404, f"task_id {inputs.task_id} is out of range; this model serves "
                                f"{len(tasks)} tasks: {tasks}")
        task = tasks[inputs.task_id]
    # An input left out is the model's (generation_config.json), else the ensemble's default.
    sampling = service.sampling_for(inputs)
    params = SamplingParams(
        max_tokens=inputs.max_tokens, min_tokens=inputs.min_length,
        temperature=sampling["temperature"], top_k=sampling["top_k"],
        top_p=sampling["top_p"] or 1.0,
        seed=None if inputs.random_seed is None else inputs.random_seed % 2**63,
        repetition_penalty=inputs.repetition_penalty, presence_penalty=inputs.presence_penalty,
        frequency_penalty=inputs.frequency_penalty, stop=list(inputs.stop_words),
        stop_token_ids=[] if inputs.end_id is None else [inputs.end_id],
        logprobs=0 if (logprobs or inputs.return_log_probs) else None,
        structured=structured_from_field(inputs.structured_outputs))
    for name in ("end_id", "pad_id"):
        value = getattr(inputs, name)
        if value is not None:
            service.check_token_ids([value], name)
    adapter = service.check_adapter(inputs.adapter if inputs.adapter is not None else adapter)
    return GenerationRequest(request_id, service.encode(inputs.text_input), params, task,
                             priority=inputs.priority, cache_salt=inputs.cache_salt,
                             adapter=adapter)


@_both("/infer", methods=["POST"])
async def infer(request: Request, model: str, version: str | None = None) -> Response:
    service = _service(request)
    service.check_capacity("triton")
    task, adapter = _choose(service, model, version)
    header, tensors = decode_request(await read_body(request), request.headers,
                                     service.limits.max_body_bytes)
    known = {n for n, *_ in OUTPUTS}
    asked = [o["name"] for o in header.get("outputs") or []]  # names checked by decode_request
    unknown = [n for n in asked if n not in known]
    if unknown:
        raise ApiError(400, f"unknown output {unknown[0]!r}; this model produces {sorted(known)}")
    rows = [validate(row, S.TritonInputs) for row in _rows(tensors)]
    if any(r.stream for r in rows):
        raise ApiError(400, "stream=true needs the generate_stream endpoint (infer answers once)")
    want_lp = any(r.return_log_probs for r in rows) or any(n in LOGPROB_OUTPUTS for n in asked)
    base_id = f"v2-{uuid.uuid4().hex}"
    requests = [to_request(service, r, task, f"{base_id}-{i}", want_lp, adapter)
                for i, r in enumerate(rows)]
    batch = await service.start(requests, "triton", request)
    results = raise_failures(await batch.collect(request))
    outputs = _output_tensors(results)
    wanted = asked or (["text_output", *LOGPROB_OUTPUTS] if want_lp else ["text_output"])
    return encode_response(header, model, outputs, wanted, request.headers.get("accept-encoding"))


def _output_tensors(results: list[Result]) -> dict[str, np.ndarray]:
    texts = np.array([r.text.encode("utf-8") for r in results], dtype=np.object_).reshape(-1, 1)
    width = max((len(r.logprobs) for r in results), default=0)
    per_token = np.zeros((len(results), width), dtype=np.float32)
    for i, r in enumerate(results):
        per_token[i, :len(r.logprobs)] = [json_logprob(lp.logprob) for lp in r.logprobs]
    cumulative = per_token.sum(axis=1, keepdims=True).astype(np.float32)
    return {"text_output": texts, "cum_log_probs": cumulative, "output_log_probs": per_token}


# ------------------------------------------------------------------------------ generate


def _generate_inputs(raw: bytes) -> S.TritonInputs:
    """The generate body: inputs at the top level or under "parameters" (both forms are used)."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the generate request must be a JSON object")
    params = body.pop("parameters", None) or {}
    if not isinstance(params, dict):
        raise ApiError(400, "'parameters' must be a JSON object")
    body.pop("id", None)
    merged = {**params, **body}
    text = merged.get("text_input")
    if isinstance(text, list) and len(text) == 1:
        merged["text_input"] = text[0]
    return validate(merged, S.TritonInputs)


async def _start_generate(request: Request, model: str, version: str | None, streaming: bool
                          ) -> tuple[S.TritonInputs, Batch]:
    service = _service(request)
    service.check_capacity("triton")
    task, adapter = _choose(service, model, version)
    inputs = _generate_inputs(await read_body(request))
    if inputs.stream and not streaming:
        raise ApiError(400, "stream=true needs the generate_stream endpoint")
    engine_request = to_request(service, inputs, task, f"gen-{uuid.uuid4().hex}",
                                adapter=adapter)
    return inputs, await service.start([engine_request], "triton", request)


@_both("/generate", methods=["POST"], openapi_extra=body_doc(S.TritonInputs))
async def generate(request: Request, model: str, version: str | None = None) -> JSONResponse:
    inputs, batch = await _start_generate(request, model, version, streaming=False)
    (result,) = raise_failures(await batch.collect(request))
    answer = S.TritonGenerateResponse(model_name=model, text_output=result.text)
    if inputs.return_log_probs:
        answer.output_log_probs = [json_logprob(lp.logprob) for lp in result.logprobs]
        answer.cum_log_probs = float(sum(answer.output_log_probs))
    return JSONResponse(answer.model_dump(exclude_none=True))


@_both("/generate_stream", methods=["POST"], openapi_extra=body_doc(S.TritonInputs))
async def generate_stream(request: Request, model: str, version: str | None = None) -> Response:
    inputs, batch = await _start_generate(request, model, version, streaming=True)
    return EventStream(_stream(model, inputs, batch))


async def _stream(model: str, inputs: S.TritonInputs, batch: Batch) -> AsyncIterator[str]:
    text, cumulative = "", 0.0
    try:
        async for _, out in batch.events():
            error = failure(out.finish_reason, out.error)
            if error is not None:
                yield sse(json.dumps({"error": error.message}))
                continue
            if not out.text and not out.token_ids:
                continue
            text += out.text
            event: dict[str, Any] = {"model_name": model, "model_version": VERSION,
                                     "text_output": text if inputs.accumulate_tokens else out.text}
            if inputs.return_log_probs:
                token_lps = [json_logprob(lp.logprob) for lp in out.logprobs or []]
                cumulative += sum(token_lps)
                event |= {"output_log_probs": token_lps, "cum_log_probs": cumulative}
            yield sse(json.dumps(event))
    finally:
        await batch.aclose()
