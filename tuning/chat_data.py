"""Conversations as tuning examples: chat rows rendered by the model's chat template.

A chat row is `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": text,
"tool_calls"?: [...]}, ...], "tools"?: [...]}` (the OpenAI / Hugging Face chat format); its task
is `"task"` when given, else `chat`. The conversation is rendered by
`core.chat_template.ChatTemplate` (the renderer `tessera serve` uses) and tokenized once as when
serving (`core.chat_template.encode_chat`: transformers' `apply_chat_template`). A token is trained on when it
overlaps the text the assistant produces (`ChatTemplate.render_with_spans`), which includes its
end-of-turn token; with `all_tokens` every token after the first is.

`bos_token` / `eos_token` in a template are the tokenizer's spellings for a Hugging Face
tokenizer, which encodes them back to their ids (BOS only where the template writes it); a
sentencepiece tokenizer would split those spellings into plain pieces, so for it they render
empty and BOS is prepended.

As a tuning example (`render_row`), a conversation's `prompt` is its tokens before the last
assistant turn and its `answer` the rest (so validation generates the last turn), and `trained`
marks the tokens with a loss. A conversation longer than the context is cut at the context and
counted as truncated; one that keeps no trained token is a `ConversationError` (`tuning.data`
adds file and line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.core.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    chat_adds_bos,
    template_specials,
)
from tessera.core.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
CHAT_TASK = "chat"


class ConversationError(ValueError):
    """A chat row that cannot be a tuning example; the caller adds where it is."""


@dataclass
class Conversation:
    """A rendered chat row: `prompt` + `answer` are its tokens, split before the last
    assistant turn; `trained` marks, per token, the ones with a loss."""

    prompt: list[int]
    answer: list[int]
    answer_text: str
    trained: list[bool]
    cut: bool  # shortened to fit the context


def is_chat_row(obj: dict[str, Any]) -> bool:
    return "messages" in obj


def check_messages(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's messages, or a `ConversationError` saying what is wrong with them."""
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConversationError("'messages' must be a non-empty list of "
                        '{"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"messages[{i}] must be an object, got {m!r}")
        if m.get("role") not in ROLES:
            raise ConversationError(f"messages[{i}] has role {m.get('role')!r}; use one of "
                            f"{', '.join(ROLES)}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ConversationError(f"messages[{i}] ({m['role']}) has no 'content' (only an "
                            "assistant turn with 'tool_calls' may leave it out)")
        if content is not None and not isinstance(content, str):
            raise ConversationError(f"messages[{i}].content must be text, got "
                            f"{type(content).__name__}")
        if "tool_calls" in m and (m["role"] != "assistant" or not isinstance(m["tool_calls"], list)):
            raise ConversationError(f"messages[{i}].tool_calls must be a list, on an "
                            "assistant turn")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ConversationError("'tools' must be a list of tool (function) schemas")
    return messages


def render_conversation(template: ChatTemplate, tokenizer: Tokenizer,
                        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        all_tokens: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation (as `core.chat_template.encode_chat` gives them) and, per
    token, whether it is trained on: it overlaps an assistant span, or `all_tokens` (a leading
    BOS excepted)."""
    text, spans = template.render_with_spans(messages, tools=tools,
                                             **template_specials(tokenizer))
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = [all_tokens or _overlaps(start, end, spans) for start, end in offsets]
    if chat_adds_bos(tokenizer):
        ids, trained = [tokenizer.bos_id, *ids], [False, *trained]
    elif all_tokens and ids and ids[0] == tokenizer.bos_id:
        trained[0] = False
    return ids, trained


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < span_end and end > span_start for span_start, span_end in spans)


def render_row(obj: dict[str, Any], template: ChatTemplate, tokenizer: Tokenizer,
               context: int, n_virtual: int, all_tokens: bool) -> Conversation:
    """A chat row as a tuning example (see the module docstring)."""
    messages = check_messages(obj)
    try:
        ids, trained = render_conversation(template, tokenizer, messages, obj.get("tools"),
                                           all_tokens)
    except ChatTemplateError as exc:
        raise ConversationError(str(exc)) from None
    keep = context - n_virtual + 1  # the last token is only a target
    cut = len(ids) > keep
    ids, trained = ids[:keep], trained[:keep]
    if not any(trained[1:]):
        why = " within the context (cut)" if cut else ""
        raise ConversationError(f"the conversation has no assistant tokens to train on{why}; "
                                "add an assistant turn, or use --all-tokens")
    start = _last_run_start(trained)
    answer = ids[start:]
    answer_text = tokenizer.decode(answer[:-1] if answer[-1] == tokenizer.eos_id else answer)
    return Conversation(ids[:start], answer, answer_text, trained, cut)


def _last_run_start(trained: list[bool]) -> int:
    """Where the last run of trained tokens starts (at least 1: a row needs a prompt token)."""
    end = max(i for i, t in enumerate(trained) if t)
    start = end
    while start > 1 and trained[start - 1]:
        start -= 1
    return start
