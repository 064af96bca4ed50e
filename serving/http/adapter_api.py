"""Hot-loading LoRA adapters over HTTP: `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`.

The routes, bodies and plain-text answers are vLLM's: `{"lora_name": NAME, "lora_path": DIR}`
loads the adapter directory DIR (a Tessera adapter, or a PEFT one when the server was started by
`tessera serve`) as NAME; `{"lora_name": NAME}` unloads it. The adapter is then selected by
`model: "BASE:NAME"` or `"NAME"` (OpenAI), `/v2/models/BASE:NAME/...` or the `adapter` input
(Triton), and the `adapter` field (`/api`); see `serving.engine.adapters`.

Security: loading reads a directory of the server's file system, so both routes are off unless
the app was made with `allow_runtime_lora=True` (`tessera serve --allow-runtime-lora`); off, they
answer 403 naming the flag. With an API key set, they need it like every other route.

Answers: 200 with a line of text; 400 for a bad body, name or adapter (unreadable, tuned on
another base, rank above `--max-lora-rank`); 404 unloading an adapter that is not loaded; 409
for a name already loaded, no free slot, or unloading an adapter that unfinished requests still
use (it is refused, not waited for: unload again once they are done). Over tensor/pipeline-
parallel ranks, every rank loads the directory from its own file system before the engine's
next step (`serving.engine.distributed`), so the answer comes after at most a step or a heartbeat.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from tessera.core.lora_format import AdapterError
from tessera.serving.engine.adapters import AdapterBusy, UnknownAdapter
from tessera.serving.http.errors import ApiError, body_doc, parse_body
from tessera.serving.http.schemas import _Request
from tessera.serving.http.security import read_body
from tessera.serving.http.service import Service

router = APIRouter(tags=["LoRA adapters"])
FLAG = "--allow-runtime-lora"


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256, description="the name to select it by")
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="an adapter directory on the server (Tessera or PEFT)")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(None, description="accepted for vLLM compatibility; unused")


def _error(status: int, what: str) -> dict:
    return {"description": what, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


_RESPONSES = {200: {"description": "done", "content": {"text/plain": {"schema": {"type": "string"}}}},
              403: _error(403, f"runtime LoRA loading is off (start with {FLAG})"),
              409: _error(409, "name taken, no free slot, or the adapter is in use")}


def _engine_of(request: Request):
    if not request.app.state.allow_runtime_lora:
        raise ApiError(403, f"loading and unloading LoRA adapters at run time is off on this "
                            f"server; start it with {FLAG} to allow it (adapters given at "
                            "start: tessera serve --lora NAME=PATH)")
    service: Service = request.app.state.service
    if not hasattr(service.engine, "load_adapter"):
        raise ApiError(400, "this engine serves no LoRA adapters")
    return service


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_RESPONSES,
             openapi_extra=body_doc(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    service = _engine_of(request)
    body = parse_body(await read_body(request), LoadLoRAAdapterRequest)
    name = body.lora_name
    if name in service.base_names or name in service.engine.tasks():
        raise ApiError(400, f"{name!r} already names this server's model or a prompt-tuned "
                            "task; give the adapter another name", param="lora_name")
    try:
        await run_in_threadpool(service.engine.load_adapter, name, body.lora_path)
    except AdapterBusy as exc:
        raise ApiError(409, str(exc), param="lora_name") from None
    except (AdapterError, OSError) as exc:
        raise ApiError(400, str(exc), param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_RESPONSES,
             openapi_extra=body_doc(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    service = _engine_of(request)
    body = parse_body(await read_body(request), UnloadLoRAAdapterRequest)
    try:  # off the event loop: over several ranks it waits for the engine's next step
        await run_in_threadpool(service.engine.unload_adapter, body.lora_name)
    except UnknownAdapter as exc:
        raise ApiError(404, str(exc), param="lora_name", code="model_not_found") from None
    except AdapterBusy as exc:
        raise ApiError(409, str(exc), param="lora_name") from None
    except AdapterError as exc:
        raise ApiError(400, str(exc)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
