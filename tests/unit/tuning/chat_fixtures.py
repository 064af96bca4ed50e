"""Chat-tuning fixtures: Llama-3.x- and Qwen2.5-style chat templates with `{% generation %}`
marks (as transformers needs them for `return_assistant_tokens_mask`), a small byte-level BPE
tokenizer trained here on Python's own sources with each style's special tokens, and a set of
conversations (system prompt, several turns, a tool call)."""

# ruff: noqa: E501  (the templates keep their one-expression-per-line Jinja layout)
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tessera.core.tokenizer import HFTokenizer

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{%- if system or tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}
    {%- if tools %}
        {{- '\\n\\nYou may call these functions, answering with JSON {"name": ..., "parameters": ...}:' }}
        {%- for tool in tools %}
            {{- '\\n' + tool | tojson(indent=4) }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- generation %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
            {%- endfor %}
        {%- else %}
            {{- message.content | trim }}
        {%- endif %}
        {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def unmarked(template: str) -> str:
    """The template without its `{% generation %}` marks (it renders the same text)."""
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


@dataclass(frozen=True)
class Style:
    name: str
    template: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str


LLAMA3 = Style("llama3", LLAMA3_TEMPLATE,
               ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"), bos="<|begin_of_text|>", eos="<|eot_id|>")
QWEN25 = Style("qwen2.5", QWEN25_TEMPLATE, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
               bos=None, eos="<|im_end|>")
STYLES = (LLAMA3, QWEN25)


def raw_tokenizer(style: Style, vocab_size: int = 600) -> RawTokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on Python's own sources."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(style.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [Path(m.__file__).read_text() for m in (argparse, json.decoder)]
    tok.train_from_iterator(texts, trainer)
    return tok


def tessera_tokenizer(style: Style, raw: RawTokenizer) -> HFTokenizer:
    return HFTokenizer(raw.to_str(), {"bos_token": style.bos, "eos_token": style.eos})


def hf_tokenizer(style: Style, raw: RawTokenizer, template: str | None = None):
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=style.bos, eos_token=style.eos,
        chat_template=template or style.template)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CONVERSATIONS: dict[str, dict] = {
    "system": {"messages": [
        {"role": "system", "content": "You are terse. Answer in one line."},
        {"role": "user", "content": "What does argparse parse?"},
        {"role": "assistant", "content": "Command-line arguments, into a Namespace."}]},
    "multi_turn": {"messages": [
        {"role": "user", "content": "Name a JSON decoder error."},
        {"role": "assistant", "content": "JSONDecodeError: it says where parsing failed."},
        {"role": "user", "content": "And its fields?"},
        {"role": "assistant", "content": "msg, doc, pos, lineno and colno."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome — café time."}]},
    "tool_call": {"tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Is it raining in Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Köln"}}}]},
        {"role": "tool", "content": '{"rain": true, "celsius": 9}'},
        {"role": "assistant", "content": "Yes: rain and 9 °C in Köln."}]},
}
