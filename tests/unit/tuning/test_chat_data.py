"""Conversations as tuning data: the token ids and the loss mask equal transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` for Llama-3.x- and Qwen2.5-style
templates, with or without `{% generation %}` marks; labels, bad rows, and the renderer shared
with the server."""

from __future__ import annotations

import json

import pytest

from tessera.core.chat_template import ChatTemplate, ChatTemplateError
from tessera.tuning.chat_data import render_conversation
from tessera.tuning.data import DataError, discover_tasks, load_examples, make_batch
from tests.unit.tuning.chat_fixtures import (
    CONVERSATIONS,
    STYLES,
    hf_tokenizer,
    raw_tokenizer,
    tessera_tokenizer,
    unmarked,
)


@pytest.fixture(scope="module", params=STYLES, ids=lambda s: s.name)
def style(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizers(style):
    raw = raw_tokenizer(style)
    return tessera_tokenizer(style, raw), hf_tokenizer(style, raw)


def _hf(hf_tok, row):
    out = hf_tok.apply_chat_template(row["messages"], tools=row.get("tools"),
                                     return_assistant_tokens_mask=True, return_dict=True,
                                     tokenize=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("marks", [True, False], ids=["marked", "prefix-by-prefix"])
def test_ids_and_mask_equal_transformers(style, tokenizers, name, marks):
    tok, hf_tok = tokenizers
    row = CONVERSATIONS[name]
    ids, mask = _hf(hf_tok, row)
    assert sum(mask) and not all(mask)  # the reference masks something and not everything
    template = ChatTemplate(style.template if marks else unmarked(style.template))
    assert template.has_generation_marks == marks
    got_ids, trained = render_conversation(template, tok, row["messages"], row.get("tools"))
    assert got_ids == ids
    assert [int(t) for t in trained] == mask
    eot = tok.encode(style.eos)[0]
    # Every assistant turn ends with its end-of-turn token, trained on; no other is.
    assert [trained[i] for i, t in enumerate(ids) if t == eot][-1]


def test_the_unmarked_template_renders_as_the_marked_one(style):
    marked, plain = ChatTemplate(style.template), ChatTemplate(unmarked(style.template))
    for row in CONVERSATIONS.values():
        for prompt in (True, False):
            assert marked.render(row["messages"], add_generation_prompt=prompt,
                                 tools=row.get("tools")) == \
                plain.render(row["messages"], add_generation_prompt=prompt, tools=row.get("tools"))


def test_all_tokens_trains_every_token_but_bos(style, tokenizers):
    tok, _ = tokenizers
    ids, trained = render_conversation(ChatTemplate(style.template), tok,
                                       CONVERSATIONS["multi_turn"]["messages"], all_tokens=True)
    first = 1 if tok.bos_id is not None else 0
    assert all(trained[first:]) and not any(trained[:first])


def test_labels_are_the_next_trained_token(style, tokenizers, tmp_path):
    tok, _ = tokenizers
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS.values()))
    assert discover_tasks(path) == ["chat"]
    data = load_examples(path, {"chat": None}, {"chat": 0}, tok, 512, add_eos=True,
                         chat_template=ChatTemplate(style.template))
    for ex, row in zip(data.examples, CONVERSATIONS.values()):
        ids, trained = render_conversation(ChatTemplate(style.template), tok, row["messages"],
                                           row.get("tools"))
        assert ex.prompt + ex.answer == ids and ex.trained == trained
        tokens, labels = make_batch([ex], {"chat": 0}, {"chat": 0}, len(ids) + 3, tok.pad_id)
        assert tokens[0, : len(ids) - 1].tolist() == ids[:-1]
        want = [t if keep else -100 for t, keep in zip(ids[1:], trained[1:])]
        assert labels[0, : len(ids) - 1].tolist() == want
        assert (labels[0, len(ids) - 1:] == -100).all()
        # The answer is the last assistant turn: the prompt ends with its generation prompt.
        assert tok.decode(ex.answer).startswith(row["messages"][-1]["content"].split()[0])


def test_a_long_conversation_is_cut_to_the_context_and_counted(style, tokenizers, tmp_path):
    tok, _ = tokenizers
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CONVERSATIONS["multi_turn"]) + "\n")
    full = load_examples(path, {"chat": None}, {"chat": 0}, tok, 512, True,
                         ChatTemplate(style.template)).examples[0]
    n = len(full.prompt) + len(full.answer)
    cut = load_examples(path, {"chat": None}, {"chat": 0}, tok, n - 6, True,
                        ChatTemplate(style.template))
    assert cut.truncated["chat"] == 1
    ex = cut.examples[0]
    assert ex.prompt + ex.answer == (full.prompt + full.answer)[: n - 5]


@pytest.mark.parametrize("row, message", [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be text"),
    ({"messages": [{"role": "user"}]}, "has no 'content'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant tokens"),
])
def test_bad_conversations_are_named_by_file_and_line(tmp_path, row, message):
    raw = raw_tokenizer(STYLES[1])
    tok = tessera_tokenizer(STYLES[1], raw)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message) as info:
        load_examples(path, {"chat": None}, {"chat": 0}, tok, 256, True,
                      ChatTemplate(STYLES[1].template))
    assert f"{path}:1" in str(info.value)


def test_a_template_that_is_not_prefix_stable_asks_for_marks():
    template = ChatTemplate("{% for m in messages %}{{ m.content }};{% endfor %}"
                            "{{ messages | length }}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="generation"):
        template.render_with_spans(messages)


def test_the_server_renders_with_the_same_template():
    from tessera.serving.http.openai_api import ChatTemplate as ServedTemplate
    from tessera.serving.http.schemas import ChatMessage

    row = CONVERSATIONS["system"]["messages"][:2]
    served = ServedTemplate(STYLES[0].template).render([ChatMessage(**m) for m in row])
    assert served == ChatTemplate(STYLES[0].template).render(row)


def test_sentencepiece_offsets_map_every_token_to_its_text(tmp_path):
    from tests.serving_helper import train_tiny_tokenizer

    tok = train_tiny_tokenizer(tmp_path)
    text = "user: café naïve 日本語\nassistant:  ok 🙂"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert all(0 <= a < b <= len(text) for a, b in offsets)
    assert [a for a, _ in offsets] == sorted(a for a, _ in offsets)
    # A multi-byte character split into byte pieces: every piece points at that character.
    assert [text[a:b] for a, b in offsets].count("🙂") >= 2
