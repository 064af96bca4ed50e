"""A model whose only tokenizer is a `tokenizer.json` (Llama 3, Qwen: byte-level BPE, no
`tokenizer.model`, no `vocab.json` / `merges.txt`) with its chat template in
`chat_template.jinja` (as transformers 5 saves it), built locally with the `tokenizers` library.

`tessera convert --from hf` keeps both files and `--to hf` writes them back; Tessera's tokenizer
encodes and decodes as transformers' `AutoTokenizer` on the same directory; and a conversation
becomes the tokens `apply_chat_template(..., tokenize=True)` gives, in `tessera serve`
(`/tokenize` and `/v1/chat/completions`) and in chat tuning, for templates that write
`bos_token` themselves (Llama 3), use `eos_token` between turns, or have no BOS (Qwen).
"""

from __future__ import annotations

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from fastapi.testclient import TestClient  # noqa: E402

from tessera.core.chat_template import ChatTemplate  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402
from tessera.serving.cli import chat_template_of  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tessera.tuning.chat_data import render_conversation  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOT]
# Llama 3's template, shortened: BOS written by the template, headers, <|eot_id|> per turn.
LLAMA3 = ("{{- bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
# Mistral's form: eos_token closes each assistant turn.
WITH_EOS = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
            "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
            "{% endfor %}")
# Qwen's form: no BOS at all, though the tokenizer has one.
NO_BOS = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|eot_id|>\n{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant\n"
          "{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello world, héllo  there."},
            {"role": "assistant", "content": " The quick brown fox."},
            {"role": "user", "content": "def main(args): return 1"}]
TEXTS = ["Hello world .", "  two  spaces\tand tab", "héllo wörld ✓ 日本", f"{EOT}x{BOS}",
         "def main(args):\n    return 1 ,"]


def _byte_level_tokenizer():
    """A Llama-3-like tokenizer.json: byte-level BPE, its specials, BOS added by the
    post-processor (as Llama 3's is)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["Hello world, this is a test. def main(args): return 1",
            "The quick brown fox jumps over the lazy dog ."] * 50
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos)])])
    return tok


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokjson")
    raw = _byte_level_tokenizer()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS,
                                                  eos_token=EOT)
    hf_tok.chat_template = LLAMA3
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=128,
        bos_token_id=raw.token_to_id(BOS), eos_token_id=raw.token_to_id(EOT))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    hf_tok.save_pretrained(root / "hf")
    check.convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return root


def _hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path)


def _hf_chat(tok, template: str, messages, opened: bool) -> list[int]:
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                  add_generation_prompt=opened)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_the_layout_is_tokenizer_json_only_and_convert_keeps_it_both_ways(root, tmp_path):
    hf = root / "hf"
    assert (hf / "tokenizer.json").is_file() and (hf / "chat_template.jinja").is_file()
    assert not any((hf / f).exists() for f in ("tokenizer.model", "vocab.json", "merges.txt"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (root / "ckpt" / name).is_file(), name
    template, origin = chat_template_of(argparse.Namespace(chat_template=None,
                                                           checkpoint=str(root / "ckpt")))
    assert template == LLAMA3 and "chat_template.jinja" in origin
    check.convert("--to", "hf", "--input", root / "ckpt", "--output", tmp_path / "out")
    theirs, back = _hf_tokenizer(hf), _hf_tokenizer(tmp_path / "out")
    assert back.chat_template == LLAMA3
    for text in TEXTS:
        assert back.encode(text) == theirs.encode(text), text


def test_encode_and_decode_as_transformers(root):
    theirs, ours = _hf_tokenizer(root / "hf"), load_tokenizer(root / "ckpt")
    assert isinstance(ours, HFTokenizer)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    engine = LLMEngine(load_checkpoint(root / "ckpt"), ours, background=False)
    for text in TEXTS:
        ids = theirs.encode(text)  # BOS first, from the tokenizer's post-processor
        assert engine.encode(text) == ids, text
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text  # special tokens kept in both
        assert ours.decode(ids[1:]) == theirs.decode(ids[1:]), text


@pytest.mark.parametrize("template", [LLAMA3, WITH_EOS, NO_BOS], ids=["llama3", "eos", "no-bos"])
def test_chat_serving_and_tuning_tokenize_as_apply_chat_template(root, template):
    theirs, ours = _hf_tokenizer(root / "hf"), load_tokenizer(root / "ckpt")
    opened = _hf_chat(theirs, template, MESSAGES, True)
    with LLMEngine(load_checkpoint(root / "ckpt"), ours) as engine, \
            TestClient(create_app(engine, model_name="m", chat_template=template)) as client:
        r = client.post("/tokenize", json={"messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == opened
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(opened)
    whole = MESSAGES[:2]  # a tuning example: the conversation, no generation prompt
    ids, trained = render_conversation(ChatTemplate(template), ours, whole)
    assert ids == _hf_chat(theirs, template, whole, False)
    assert not trained[0] and any(trained)


def test_a_tokenizer_json_that_adds_no_bos_serves_prompts_without_one(root, tmp_path):
    """OLMo-2's and GPT-2's tokenizer.json name a BOS token but their post-processor adds none,
    so transformers encodes a prompt without it; the server must too."""
    from tokenizers import processors

    raw = _byte_level_tokenizer()
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=EOT,
                                                  eos_token=EOT)
    hf_tok.save_pretrained(tmp_path)
    theirs, ours = _hf_tokenizer(tmp_path), load_tokenizer(tmp_path)
    assert ours.bos_id == theirs.bos_token_id is not None and not ours.adds_bos
    engine = LLMEngine(load_checkpoint(root / "ckpt"), ours, background=False)
    for text in TEXTS:
        assert engine.encode(text) == theirs.encode(text), text
