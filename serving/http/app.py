"""`create_app(engine, ...)`: the FastAPI app serving one engine in three dialects.

    app = create_app(LLMEngine.from_checkpoint(path), model_name="tiny", api_key="secret")
    uvicorn.run(app, host="0.0.0.0", port=8000)

| routes | dialect | module |
|---|---|---|
| `/v1/models`, `/v1/completions`, `/v1/chat/completions` | OpenAI | `openai_api` |
| `/v2`, `/v2/health/*`, `/v2/models/...`, `/v2/repository/index` | KServe v2 / Triton | `triton_api` |
| `PUT /api` | Megatron-LM | `megatron_api` |
| `/tokenizer_info`, `/tokenize`, `/detokenize` | vLLM's tokenizer routes | `tokenizer_api` |
| `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` | vLLM's LoRA hot-loading | `adapter_api` |
| `/health`, `/metrics`, `/docs` | operations | here |

The app stays thin: routes decode a request, `Service` runs it on the engine (admission,
timeouts, disconnects, metrics), and the route encodes the answer. `GuardMiddleware` checks the
API key (all routes but health) and the body size before any route runs.

The app does not own the engine: whoever made it starts and shuts it down (`tessera serve`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tessera.serving.http import (
    adapter_api,
    megatron_api,
    openai_api,
    openapi_doc,
    tokenizer_api,
    triton_api,
)
from tessera.serving.http.errors import install_error_handlers
from tessera.serving.http.openai_api import ChatTemplate
from tessera.serving.http.security import OPEN_PATHS, GuardMiddleware
from tessera.serving.http.service import Limits, Service
from tessera.serving.http.version import SERVER_VERSION
from tessera.serving.types import Engine

operations = APIRouter(tags=["operations"])


@operations.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine runs, else 503 (no body, no API key)."""
    return Response(status_code=200 if is_ready(request) else 503)


def is_ready(request: Request) -> bool:
    """The engine is alive (engines without an `alive` attribute always are)."""
    return bool(getattr(request.app.state.service.engine, "alive", True))


@operations.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format; see `tessera.serving.http.metrics` for the series."""
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    engine: Engine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = Limits.max_body_bytes,
    max_prompt_tokens: int | None = Limits.max_prompt_tokens,
    max_concurrency: int = Limits.max_concurrency,
    request_timeout_s: float | None = Limits.request_timeout_s,
    chat_template: str | None = None,
    model_aliases: tuple[str, ...] = (),
    body_timeout_s: float | None = Limits.body_timeout_s,
    allow_runtime_lora: bool = False,
    sampling_defaults: Mapping[str, float | int] | None = None,
) -> FastAPI:
    """The HTTP app for `engine`, served under `model_name`.

    Args:
        api_key: when set, every route except `/health` and `/v2/health/*` needs
            `Authorization: Bearer API_KEY` (401 otherwise).
        max_body_bytes: larger request bodies (also after decompression) get a 413.
        max_prompt_tokens: longer prompts get a 400 (None: whatever the engine's context allows).
        max_concurrency: generation requests admitted at once (n > 1 counts n); beyond it a
            request gets 429 with Retry-After before any work is done.
        request_timeout_s: wall-time limit of one generation request, queueing included.
        chat_template: a Jinja chat template (Hugging Face conventions) for
            `/v1/chat/completions`; default: "role: content" lines, then "assistant:".
        model_aliases: more names the base model answers to (answers name `model_name`).
        body_timeout_s: a request body that stalls this long gets 408 and a closed connection
            (the header deadline is the server's: `serving.http.connections`).
        allow_runtime_lora: let `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
            load and unload LoRA adapters (`serving.http.adapter_api`); off, they answer 403.
        sampling_defaults: `temperature` / `top_p` / `top_k` for requests of every protocol that
            do not set them (the checkpoint's `generation_config.json`,
            `core.generation_defaults`).
    """
    if max_concurrency < 1 or max_body_bytes < 1:
        raise ValueError("max_concurrency and max_body_bytes must be positive")
    limits = Limits(max_body_bytes=max_body_bytes, max_prompt_tokens=max_prompt_tokens,
                    max_concurrency=max_concurrency, request_timeout_s=request_timeout_s,
                    body_timeout_s=body_timeout_s)
    app = FastAPI(title=f"Tessera: {model_name}", version=SERVER_VERSION, redoc_url=None,
                  description="OpenAI, KServe v2 / Triton and Megatron-LM text generation.")
    app.state.service = Service(engine, model_name, limits, tuple(model_aliases),
                                sampling_defaults)
    app.state.chat_template = ChatTemplate(chat_template)  # a broken template fails here
    app.state.started = time.time()
    app.state.allow_runtime_lora = allow_runtime_lora
    install_error_handlers(app)
    for router in (openai_api.router, triton_api.router, megatron_api.router,
                   tokenizer_api.router, adapter_api.router, operations):
        app.include_router(router)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]
    return app


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the request bodies the routes document via `errors.body_doc`."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                components.update(operation.pop("x-schemas", {}))
        app.openapi_schema = openapi_doc.complete(schema, OPEN_PATHS)
    return app.openapi_schema
