"""Tool calling in chat completions: the chat template's tool-call format, the grammar that
forces a call, and the parser that reads calls back out of the generated text.

Formats (told apart by the chat template's source, `format_of`):
- "llama3": Llama 3.x JSON tool calling: `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`; several separated by `;`);
- "qwen": Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`tool_choice` "required" or a named function is enforced by a JSON-schema grammar of one call in
the format (`forced_call`); "auto" lets the model choose and parses what it wrote; "none" renders
no tools and parses nothing. Text that does not parse as calls stays the message's content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tessera.serving.http import schemas as S
from tessera.serving.types import StructuredOutput

FORMATS = ("llama3", "qwen", "mistral")
_PYTHON_TAG = "<|python_tag|>"


def format_of(template_source: str) -> str | None:
    """The tool-call format a chat template writes (None: it has none)."""
    if "<tool_call>" in template_source:
        return "qwen"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if _PYTHON_TAG in template_source or (
            "<|start_header_id|>" in template_source and "parameters" in template_source
            and "tools" in template_source):
        return "llama3"
    return None


def template_messages(messages: list[S.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (Hugging Face conventions): text content, and an
    assistant's `tool_calls` with `arguments` as an object (JSON text that is not one stays
    text); a tool message keeps `tool_call_id` and `name`."""
    turns = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            turn["name"] = m.name
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments_object(c.function.arguments)}}
                for c in m.tool_calls]
        turns.append(turn)
    return turns


def _arguments_object(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def template_tools(tools: list[S.Tool]) -> list[dict[str, Any]]:
    """`tools` as chat templates read them (OpenAI's shape, as plain data)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def _args_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3" else "arguments"


def _call_schema(fmt: str, tool: S.Tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             _args_key(fmt): params},
            "required": ["name", _args_key(fmt)], "additionalProperties": False}


def forced_call(fmt: str, tools: list[S.Tool],
                choice: str | S.NamedToolChoice) -> StructuredOutput:
    """The constraint of one call (to the named tool, or to any of `tools` for "required") in
    the format's own wrapping."""
    if isinstance(choice, S.NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    schemas = [_call_schema(fmt, t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    prefix, suffix = {"llama3": ("", ""), "qwen": ("<tool_call>\n", "\n</tool_call>"),
                      "mistral": ("[TOOL_CALLS][", "]")}[fmt]
    return StructuredOutput("json_schema", schema, prefix=prefix, suffix=suffix)


def _call(obj: Any, fmt: str) -> dict[str, Any] | None:
    """An OpenAI `tool_calls` item of one decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(_args_key(fmt), obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values of `text`, one after another (between them: whitespace and
    `separators`); None if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse_tool_calls(fmt: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a generated message; text that is not a well-formed call in
    the format is all content."""
    content, objects = text, None
    if fmt == "qwen" and "<tool_call>" in text:
        content, _, rest = text.partition("<tool_call>")
        objects = []
        for part in re.split(r"</?tool_call>", rest):
            values = _json_values(part, "")
            if values is None:
                objects = None
                break
            objects += values
    elif fmt == "mistral" and "[TOOL_CALLS]" in text:
        content, _, rest = text.partition("[TOOL_CALLS]")
        values = _json_values(rest, "")
        objects = values[0] if values and len(values) == 1 and isinstance(values[0], list) \
            else None
    elif fmt == "llama3":
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):]
        if body.lstrip().startswith("{"):
            objects, content = _json_values(body, ";"), ""
    if objects is None:
        return text, []
    calls = [_call(o, fmt) for o in objects]
    if not calls or any(c is None for c in calls):
        return text, []
    return (content.strip() or None), calls  # type: ignore[return-value]


@dataclass
class ToolCallStream:
    """Streams a message whose text may hold tool calls: content goes out as it comes, up to
    where a call may begin; the calls go out at the end (`finish`), as OpenAI deltas."""

    fmt: str
    text: str = ""
    sent: int = 0  # content characters sent

    def _held_from(self) -> int:
        """Where the text that may be a call begins (len(text): nothing held)."""
        if self.fmt == "llama3":
            head = self.text.lstrip()
            if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]):
                return 0
            return len(self.text)
        marker = "<tool_call>" if self.fmt == "qwen" else "[TOOL_CALLS]"
        at = self.text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(self.text)), 0, -1):  # a marker's beginning
            if self.text.endswith(marker[:k]):
                return len(self.text) - k
        return len(self.text)

    def feed(self, delta: str) -> str:
        """Add generated text; returns the content that can be sent now."""
        self.text += delta
        end = max(self._held_from(), self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet, and the calls' deltas (each call: its id and name, then
        its arguments), once the text is complete."""
        content, calls = parse_tool_calls(self.fmt, self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        content = content or ""
        rest = content[self.sent:] if len(content) > self.sent else ""
        self.sent = len(self.text)
        return rest, call_deltas(calls)


def call_deltas(calls: list[dict[str, Any]], piece: int = 16) -> list[dict[str, Any]]:
    """Streaming `tool_calls` deltas that assemble to `calls`: per call, one with its index, id,
    type and name, then its arguments in pieces of `piece` characters."""
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        fn = call["function"]
        out.append({"index": index, "id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}})
        args = fn["arguments"]
        out += [{"index": index, "function": {"arguments": args[i:i + piece]}}
                for i in range(0, len(args), piece)]
    return out
