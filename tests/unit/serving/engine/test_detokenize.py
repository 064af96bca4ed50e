"""Incremental text: multi-byte characters and stop strings are released only when final."""

import pytest

from tessera.serving.engine.detokenize import IncrementalDecoder, OutputText, find_stop, stop_prefix_length
from tests.serving_helper import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_byte_fallback_characters_appear_whole(tok):
    text = " Grüße aus 日本 🙂 und café"
    ids = tok.encode(text)
    assert any(tok._sp.id_to_piece(i).startswith("<0x") for i in ids)  # byte pieces in play
    decoder = IncrementalDecoder(tok, [])
    for i in ids:
        decoder.push(i)
        assert "\ufffd" not in decoder.text
        assert text.lstrip().startswith(decoder.text.lstrip())
    assert decoder.flush() == tok.decode(ids)


def _split(tok, text: str, prompt: str) -> tuple[list[int], list[int]]:
    """Token ids of `text` split after those that decode to `prompt`."""
    ids = tok.encode(text)
    n = next(n for n in range(len(ids) + 1) if tok.decode(ids[:n]) == prompt)
    return ids[:n], ids[n:]


def test_continuation_keeps_its_leading_space(tok):
    prompt, rest = _split(tok, "import json def parse(self):\n    return 1", "import json")
    decoder = IncrementalDecoder(tok, prompt)
    for i in rest:
        decoder.push(i)
    assert decoder.text == " def parse(self):\n    return 1"


def test_unfinished_bytes_are_flushed_at_the_end(tok):
    ids = tok.encode("日")[-3:-1]  # two of the three bytes
    decoder = IncrementalDecoder(tok, [])
    for i in ids:
        decoder.push(i)
    assert decoder.text == "" and decoder.flush().startswith("\ufffd")


def test_stop_helpers():
    assert stop_prefix_length("hello wor", ["world", "xyz"]) == 3
    assert stop_prefix_length("hello", ["world"]) == 0
    assert stop_prefix_length("ab", ["b", "abc"]) == 2
    assert find_stop("a stop b stop", ["stop"], 0, 5) == 2
    assert find_stop("a stop b stop", ["stop"], 0, 7) == 9  # only matches ending in new text
    assert find_stop("xx END yy", ["yy", "END"], 0, 0) == 3


def test_stop_string_is_held_back_then_cut(tok):
    prompt, rest = _split(tok, "x = 1 + 2\n    return 3", "x =")
    out = OutputText(tok, prompt, ["return"])
    sent, stopped = "", False
    for i in rest:
        stopped = out.add(i, None, check_stop=True)
        ids, text, _ = out.take(final=stopped)
        sent += text
        assert "ret" not in sent
        if stopped:
            break
    assert stopped and sent == " 1 + 2\n    "


def test_stop_prefix_that_does_not_complete_is_released(tok):
    prompt, rest = _split(tok, "x = ret", "x =")
    out = OutputText(tok, prompt, ["return"])
    sent = ""
    for i in rest:
        out.add(i, None, check_stop=True)
        sent += out.take()[1]
    assert sent == " "  # "ret" might begin "return": held
    ids, text, _ = out.take(final=True)
    assert sent + text == " ret"
