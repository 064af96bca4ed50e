"""The tokenizer over HTTP, in the shapes vLLM serves: `GET /tokenizer_info`, `POST /tokenize`,
`POST /detokenize`. lm-evaluation-harness (`tokenizer_backend=remote`, or `auto` when these
answer) tokenizes through them, so it needs no tokenizer download and counts tokens exactly as
this server does.

- `POST /tokenize {"prompt": str, "add_special_tokens": true}` -> `{"count", "max_model_len",
  "tokens", "token_strs"}`; `add_special_tokens` adds BOS as the completion routes do for a text
  prompt. The special tokens' own spellings (`</s>`) in the text are their ids, as Hugging Face
  tokenizers do (lm-eval finds the EOS id by tokenizing `eos_token`). With `"messages"` instead
  of `"prompt"`: the tokens `/v1/chat/completions` would run (the template rendered and
  tokenized as transformers' `apply_chat_template` does, `core.chat_template.encode_chat`).
- `POST /detokenize {"tokens": [...]}` -> `{"prompt": str}`; ids outside the vocabulary: 400.
- `GET /tokenizer_info` -> the special tokens (`bos_token`, `eos_token`, `pad_token`, and their
  ids), `chat_template`, `model_max_length`, `tokenizer_class`.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from tessera.serving.http import schemas as S
from tessera.serving.http.errors import ApiError, body_doc, parse_body
from tessera.serving.http.security import read_body
from tessera.serving.http.service import Service

router = APIRouter(tags=["tokenizer"])


def _service(request: Request) -> Service:
    return request.app.state.service


def _tokenizer(service: Service) -> Any:
    tokenizer = getattr(service.engine, "tokenizer", None)
    if tokenizer is None:
        raise ApiError(404, "this model has no tokenizer: send token ids")
    return tokenizer


@router.get("/tokenizer_info", response_model=S.TokenizerInfo)
async def tokenizer_info(request: Request) -> S.TokenizerInfo:
    service = _service(request)
    tokenizer = _tokenizer(service)

    def name(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.token_text(token_id)

    return S.TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__, bos_token=name(tokenizer.bos_id),
        eos_token=name(tokenizer.eos_id), pad_token=name(tokenizer.pad_id),
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
        chat_template=request.app.state.chat_template.source,
        model_max_length=service.engine.max_context(), vocab_size=service.vocab_size)


@router.post("/tokenize", response_model=S.TokenizeResponse, openapi_extra=body_doc(S.TokenizeRequest))
async def tokenize(request: Request) -> S.TokenizeResponse:
    service = _service(request)
    body = parse_body(await read_body(request), S.TokenizeRequest)  # a bad body is a 400 first
    tokenizer = _tokenizer(service)
    if body.messages is not None:
        text = request.app.state.chat_template.render(body.messages, **service.chat_specials())
        ids = service.encode_chat(text)
    else:
        ids = _encode_with_specials(service, tokenizer, body.prompt or "", body.add_special_tokens)
    strs = [tokenizer.token_text(i) for i in ids] if body.return_token_strs else None
    return S.TokenizeResponse(count=len(ids), max_model_len=service.engine.max_context(),
                              tokens=ids, token_strs=strs)


def _encode_with_specials(service: Service, tokenizer: Any, text: str, add_bos: bool) -> list[int]:
    """`text` encoded with each special token's spelling (BOS, EOS, PAD) taken as its id."""
    specials = {tokenizer.token_text(i): i for i in {tokenizer.bos_id, tokenizer.eos_id,
                                                     tokenizer.pad_id} if i is not None}
    specials = {k: v for k, v in specials.items() if k}
    ids = service.engine.encode("", add_bos=True) if add_bos else []
    if not specials:
        return ids + service.engine.encode(text, add_bos=False)
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    for i, part in enumerate(re.split(pattern, text)):
        if i % 2:
            ids.append(specials[part])
        elif part:
            ids += service.engine.encode(part, add_bos=False)
    return ids


@router.post("/detokenize", response_model=S.DetokenizeResponse,
             openapi_extra=body_doc(S.DetokenizeRequest))
async def detokenize(request: Request) -> S.DetokenizeResponse:
    service = _service(request)
    body = parse_body(await read_body(request), S.DetokenizeRequest)
    _tokenizer(service)
    ids = service.check_token_ids(body.tokens, "tokens")
    return S.DetokenizeResponse(prompt=service.engine.decode(ids))
