"""Chat templates: a conversation rendered as text by the model's Jinja template, as served and
as tuned.

Contract (Hugging Face conventions, so a template from the Hub renders here as it does in
transformers):
- The template sees `messages` (dicts with `role`, `content` and any other keys such as
  `tool_calls`), `add_generation_prompt`, `tools` when given, `bos_token` and `eos_token`, the
  `raise_exception(message)` and `strftime_now(format)` functions, and a `tojson` filter that
  keeps non-ASCII text and key order and escapes no HTML.
- `{% generation %}...{% endgeneration %}` marks the text the assistant produces. Rendering
  ignores the marks; `render_with_spans` returns the marked character spans. For a template
  without marks the spans are found by rendering prefix by prefix: an assistant turn is what
  the conversation up to it adds beyond the conversation before it with the generation prompt
  appended, trailing whitespace excluded (the separator between turns, which the model never
  writes before it stops). A template that does not render conversations prefix by prefix
  is refused there with a message asking for marks.
- `stored_chat_template(checkpoint)` finds the template kept with a model.
- `template_specials(tokenizer)` and `encode_chat(tokenizer, text)`: what serving and chat
  tuning render and tokenize, as transformers' `apply_chat_template(..., tokenize=True)` does
  for a Hugging Face tokenizer: `bos_token` / `eos_token` are the tokenizer's spellings, and the
  text is tokenized with no special tokens added (the template writes BOS where the model wants
  one; the spellings in the text encode to their ids). A sentencepiece tokenizer would split
  those spellings into plain pieces, so for it they render empty and BOS is prepended.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from tessera.core.tokenizer import Tokenizer

# BOS, "role: content" lines, then the assistant's turn opened for the model to continue.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Private-use characters that bracket generation-marked text while spans are being found.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKING = "__tessera_mark_generation"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Span = tuple[int, int]  # [start, end) character offsets into the rendered text


class ChatTemplateError(ValueError):
    """A template that is not valid Jinja, or that fails on a conversation."""


class _GenerationMarks(Extension):
    """`{% generation %}body{% endgeneration %}`: the body, bracketed by `_OPEN`/`_CLOSE` when
    the render asks for marks."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark", [nodes.ContextReference()]), [], [],
                               body).set_lineno(lineno)

    def _mark(self, context: Context, caller: Any) -> str:
        text = caller()
        return f"{_OPEN}{text}{_CLOSE}" if context.get(_MARKING) else text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled Jinja chat template; see the module docstring for what it sees."""

    def __init__(self, source: str | None = None) -> None:
        self.source = source or DEFAULT_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationMarks, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from None

    @property
    def has_generation_marks(self) -> bool:
        """Whether the template marks the assistant's text with `{% generation %}`."""
        return bool(_GENERATION_TAG.search(self.source))

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, bos_token: str = "",
               eos_token: str = "") -> str:
        """The conversation as text. The defaults are the server's: the assistant's turn is
        opened, and BOS is empty because the tokenizer adds it."""
        return self._render(messages, add_generation_prompt, tools, bos_token, eos_token, False)

    def render_with_spans(self, messages: Sequence[dict[str, Any]], *,
                          tools: list[dict[str, Any]] | None = None, bos_token: str = "",
                          eos_token: str = "") -> tuple[str, list[Span]]:
        """The whole conversation as text (no generation prompt) and the character spans of the
        assistant's text in it, in order."""
        if self.has_generation_marks:
            marked = self._render(messages, False, tools, bos_token, eos_token, True)
            return _strip_marks(marked)
        full = self.render(messages, add_generation_prompt=False, tools=tools,
                           bos_token=bos_token, eos_token=eos_token)
        spans: list[Span] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools,
                                 bos_token=bos_token, eos_token=eos_token) if i else ""
            through = self.render(messages[: i + 1], add_generation_prompt=False, tools=tools,
                                  bos_token=bos_token, eos_token=eos_token).rstrip()
            if not (through.startswith(before) and full.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template does not render this conversation prefix by prefix (at "
                    f"message {i}), so the assistant's tokens cannot be found; mark them in the "
                    "template with {% generation %}...{% endgeneration %}")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return full, spans

    def _render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, bos_token: str, eos_token: str,
                marking: bool) -> str:
        if marking and any(_OPEN in s or _CLOSE in s for s in _strings(messages)):
            raise ChatTemplateError("a message contains the private-use characters U+E000 or "
                                    "U+E001, which mark the assistant's text; remove them")
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token,
                                         **{_MARKING: marking}, **extra)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


def _strip_marks(marked: str) -> tuple[str, list[Span]]:
    """Text without the generation marks, and the spans they bracketed (empty ones dropped)."""
    out: list[str] = []
    spans: list[Span] = []
    length, start = 0, None
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece == _OPEN:
            start = length
        elif piece == _CLOSE:
            if start is not None and length > start:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    return "".join(out), spans


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def stored_chat_template(checkpoint: str | Path) -> tuple[str | None, str]:
    """The chat template kept with the model and the file it is in: `chat_template.jinja`
    (what transformers saves), `chat_template.json`, or `tokenizer_config.json`'s
    `chat_template` (all carried over by `tessera convert --from hf`); (None, "") if none."""
    root = Path(checkpoint)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(), "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (root / name).is_file():
            template = json.loads((root / name).read_text()).get("chat_template")
            if isinstance(template, str):
                return template, name
    return None, ""


def _spells_specials(tokenizer: Tokenizer) -> bool:
    """Whether special-token spellings in a text encode to their ids (Hugging Face tokenizers)."""
    return tokenizer.kind == "huggingface"


def template_specials(tokenizer: Tokenizer | None) -> dict[str, str]:
    """`bos_token` and `eos_token` as a template renders them for `tokenizer` (see the module
    docstring); empty for a sentencepiece tokenizer or none."""
    if tokenizer is None or not _spells_specials(tokenizer):
        return {"bos_token": "", "eos_token": ""}
    return {f"{name}_token": "" if i is None else tokenizer.token_text(i)
            for name, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))}


def chat_adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether `encode_chat` prepends BOS itself (a sentencepiece tokenizer with a BOS token)
    rather than leaving it to the template."""
    return not _spells_specials(tokenizer) and tokenizer.bos_id is not None


def encode_chat(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a conversation rendered with `template_specials(tokenizer)`."""
    return tokenizer.encode(text, bos=chat_adds_bos(tokenizer))
