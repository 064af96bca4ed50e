"""Tool calling through the openai SDK against `tessera serve` (a real process) with a Llama
3.x-style and a Qwen2.5-style chat template: calls are parsed, streamed deltas assemble to the
same call, and `tool_choice: required` (or a named function) always calls a tool with
arguments that validate against its parameters. Plus the per-format parsers and rendering.

References: the openai SDK's own models of responses and stream chunks, and `jsonschema`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.serving.http import schemas as S
from tessera.serving.http.openai_api import ChatTemplate
from tessera.serving.http.tool_calls import ToolCallStream, format_of, parse_tool_calls
from tests.serving_helper import train_tiny_tokenizer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 4},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
    "additionalProperties": False}
# Short names and bounded arguments: a call is a few dozen tokens of a tiny random model.
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    train_tiny_tokenizer(root)
    config = ModelConfig.from_name("llama-tiny", vocab_size=512, init_std=0.3,
                                   max_position_embeddings=1024)
    return save_checkpoint(root / "ckpt", build_model(config, seed=0).eval(),
                           tokenizer=root / "tokenizer.model")


@pytest.fixture(scope="module", params=["llama3_tools.jinja", "qwen25_tools.jinja"])
def server(request, checkpoint, tmp_path_factory):
    """`tessera serve` with one template; yields (openai client, template format)."""
    port = _free_port()
    template = TEMPLATES / request.param
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with log.open("wb") as err:  # a file, not a pipe nobody drains
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera", "serve", "--checkpoint", str(checkpoint),
             "--chat-template", str(template), "--port", str(port), "--dtype", "fp32",
             "--max-batch", "4"], stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "tessera serve did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield (openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0),
               format_of(template.read_text()))
    finally:
        proc.terminate()
        proc.wait(30)


def _check_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _assemble(stream) -> tuple[str, list[tuple[str, str]], str]:
    """Content, [(name, arguments)] and finish reason from a stream of chunks."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


def test_the_templates_are_told_apart(server):
    _, fmt = server
    assert fmt in ("llama3", "qwen")


def test_required_always_calls_a_tool_with_valid_arguments(server):
    client, _ = server
    for seed in range(3):
        r = client.chat.completions.create(model="ckpt", messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=1.0, seed=seed,
                                           max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])


def test_a_named_function_is_called_and_its_streamed_deltas_assemble_to_the_same_call(server):
    client, _ = server
    kwargs = dict(model="ckpt", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "add" and whole.finish_reason == "tool_calls"
    _check_call(call)
    content, calls, reason = _assemble(client.chat.completions.create(stream=True, **kwargs))
    assert reason == "tool_calls"
    assert calls == [(call.function.name, call.function.arguments)]
    assert content == (whole.message.content or "")


def test_a_conversation_with_calls_and_tool_results_continues(server):
    """An assistant turn with tool_calls and a tool message render through the template."""
    client, _ = server
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = client.chat.completions.create(model="ckpt", messages=messages, tools=TOOLS,
                                       tool_choice="auto", temperature=0, max_tokens=4)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 50
    none = client.chat.completions.create(model="ckpt", messages=ASK, tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=4)
    assert none.choices[0].message.tool_calls is None


# ------------------------------------------------------------------ rendering and parsing


def _messages(raw) -> list[S.ChatMessage]:
    return [S.ChatMessage.model_validate(m) for m in raw]


@pytest.mark.parametrize("name, call", [
    ("llama3_tools.jinja", '{"name": "weather", "parameters": {"city": "Rome", "unit": "celsius"}}'),
    ("qwen25_tools.jinja", '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", '
                           '"unit": "celsius"}}\n</tool_call>'),
])
def test_templates_render_calls_in_the_format_their_parser_reads(name, call):
    template = ChatTemplate((TEMPLATES / name).read_text())
    text = template.render(_messages(ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}]),
        [S.Tool.model_validate(t) for t in TOOLS])
    assert call in text and "21 degrees" in text and '"name": "add"' in text
    _, calls = parse_tool_calls(template.tool_format, call)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("weather", {"city": "Rome", "unit": "celsius"})]


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     None, [("f", {"x": 1}), ("g", {})]),
    ("llama3", 'It is sunny {"name": "f"}', 'It is sunny {"name": "f"}', []),
    ("qwen", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": "a"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "Let me look.", [("f", {"x": "a"}), ("g", {})]),
    ("qwen", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 2}}, {"name": "g", "arguments": {}}]',
     None, [("f", {"x": 2}), ("g", {})]),
    ("mistral", "plain answer", "plain answer", []),
])
def test_parsers(fmt, text, content, calls):
    got_content, got = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("fmt, pieces, calls", [
    ("qwen", ["Sure", " <tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"],
     1),
    ("mistral", ["ok ", "[TOOL", "_CALLS][{\"name\": \"f\", \"arguments\": {}}]"], 1),
    ("llama3", ["{\"name\": \"f\", ", "\"parameters\": {\"a\": 1}}"], 1),
    ("llama3", ["The", " answer"], 0),
])
def test_streamed_content_stops_where_a_call_begins(fmt, pieces, calls):
    stream = ToolCallStream(fmt)
    sent = "".join(stream.feed(p) for p in pieces)
    rest, deltas = stream.finish()
    content, parsed = parse_tool_calls(fmt, "".join(pieces))
    assert "<tool" not in sent and "[TOOL" not in sent and "{" not in sent
    assert len(parsed) == calls
    if calls:
        assert (sent + rest).strip() == (content or "")
        args = "".join(d["function"]["arguments"] for d in deltas)
        assert args == parsed[0]["function"]["arguments"]
    else:
        assert sent + rest == "".join(pieces) and deltas == []
