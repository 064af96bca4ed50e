"""A client that hangs up aborts its engine requests (streaming and not), and frees the slots.

The app is driven directly over ASGI, with a `receive` that reports the disconnect, so the
test does not depend on how a particular HTTP client closes its sockets.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tessera.serving.http.app import create_app

from ..fake_engine import FakeEngine


async def _call_and_hang_up(app, body: dict, hang_up_after_s: float) -> list[dict]:
    sent: list[dict] = []
    payload = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.sleep(hang_up_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("prompt", ["SLOW", "HANG"])  # generating / still waiting for a first token
def test_disconnect_aborts_the_request(stream, prompt):
    engine = FakeEngine()
    app = create_app(engine, model_name="fake")
    body = {"prompt": prompt, "max_tokens": 50, "n": 2, "stream": stream}
    sent = asyncio.run(_call_and_hang_up(app, body, hang_up_after_s=0.5))
    assert len(engine.started) == 2
    assert engine.aborted == {r.request_id for r in engine.started}  # 50 tokens x 0.2 s: not done
    assert not engine.active and app.state.service.admitted == 0
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    if stream and prompt == "SLOW":
        assert 0 < len(chunks) < 10


def test_hanging_up_on_a_finished_stream_aborts_nothing():
    engine = FakeEngine()
    app = create_app(engine, model_name="fake")
    asyncio.run(_call_and_hang_up(app, {"prompt": "ab", "max_tokens": 3, "stream": True}, 0.3))
    assert not engine.aborted and len(engine.finished) == 1
