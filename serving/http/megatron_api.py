"""The Megatron-LM dialect: `PUT /api`, as Megatron's `text_generation_server` answers it.

Request: `{"prompts": [...], "tokens_to_generate": 64, "temperature", "top_k", "top_p",
"logprobs", "random_seed", "add_BOS", "stop_on_eol", "stop_on_double_eol", "task"}`, and
Tessera's `adapter` (a loaded LoRA adapter), `priority` and `cache_salt`.
Answer: `{"text": [prompt + continuation, ...], "segments": [[token text, ...], ...],
"logprobs": [[logprob of every token after the first], ...]}` (logprobs only when asked).
`tokens_to_generate: 0` with `logprobs: true` scores the prompts. Errors: `{"error": "..."}`.

One difference from Megatron: `add_BOS` defaults to true, since Tessera's tokenizers are
trained with a BOS token that every training document starts with.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.serving.http import schemas as S
from tessera.serving.http.errors import ApiError, body_doc, parse_body
from tessera.serving.http.security import read_body
from tessera.serving.http.service import Result, Service, json_logprob, raise_failures
from tessera.serving.http.structured import structured_from_field
from tessera.serving.http.token_text import TokenTexts, fit_to, prompt_texts
from tessera.serving.types import GenerationRequest, SamplingParams

router = APIRouter(tags=["Megatron-LM"])


def decode_request(service: Service, body: S.MegatronRequest) -> list[GenerationRequest]:
    if body.tokens_to_generate == 0 and not body.logprobs:
        raise ApiError(400, "tokens_to_generate=0 only scores the prompts: set logprobs to true")
    if body.task is not None:
        service.check_task(body.task)
    service.check_adapter(body.adapter)
    stop = (["\n"] if body.stop_on_eol else []) + (["\n\n"] if body.stop_on_double_eol else [])
    seed = None if body.random_seed in (None, -1) else body.random_seed
    base_id = f"api-{uuid.uuid4().hex}"
    requests = []
    # A field left out is the model's (generation_config.json), else Megatron's default.
    sampling = service.sampling_for(body)
    for i, prompt in enumerate(body.prompts):
        params = SamplingParams(
            max_tokens=body.tokens_to_generate, temperature=sampling["temperature"],
            top_k=sampling["top_k"], top_p=sampling["top_p"] or 1.0, seed=seed, stop=stop,
            logprobs=0 if body.logprobs else None, prompt_logprobs=body.logprobs,
            structured=structured_from_field(body.structured_outputs))
        ids = service.encode(prompt, add_bos=body.add_BOS)
        requests.append(GenerationRequest(f"{base_id}-{i}", ids, params, body.task,
                                          priority=body.priority, cache_salt=body.cache_salt,
                                          adapter=body.adapter))
    return requests


def encode_response(service: Service, body: S.MegatronRequest, results: list[Result]) -> S.MegatronResponse:
    decode = service.engine.decode
    texts, segments, logprobs = [], [], []
    for prompt, r in zip(body.prompts, results):
        texts.append(prompt + r.text)
        # Token texts that concatenate to the text (leading spaces kept, BOS empty).
        bos = service.bos_ids if body.add_BOS else []
        segments.append(prompt_texts(decode, r.prompt_ids, bos)
                        + fit_to(TokenTexts(decode, r.prompt_ids).texts(r.token_ids), r.text))
        prompt_lps = [None if e is None else e.logprob for e in (r.prompt_logprobs or [])][1:]
        prompt_lps += [None] * (len(r.prompt_ids) - 1 - len(prompt_lps))
        logprobs.append([json_logprob(x) if x is not None else 0.0 for x in prompt_lps]
                        + [json_logprob(e.logprob) for e in r.logprobs])
    return S.MegatronResponse(text=texts, segments=segments, logprobs=logprobs if body.logprobs else None)


@router.put("/api", response_model=S.MegatronResponse, openapi_extra=body_doc(S.MegatronRequest))
async def megatron_generate(request: Request) -> JSONResponse:
    service: Service = request.app.state.service
    service.check_capacity("megatron")
    body = parse_body(await read_body(request), S.MegatronRequest)
    batch = await service.start(decode_request(service, body), "megatron", request)
    results = raise_failures(await batch.collect(request))
    return JSONResponse(encode_response(service, body, results).model_dump(exclude_none=True))
