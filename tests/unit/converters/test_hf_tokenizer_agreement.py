"""HF export and import agree with the server: the exported tokenizer adds BOS as `tessera serve`
does for a text prompt, and a chat template saved by transformers (`chat_template.jinja`) is
carried into the checkpoint and back out, and served."""

from __future__ import annotations

import argparse

import transformers

from tessera.converters.hf_io import export_hf, import_hf
from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.serving.cli import chat_template_of
from tessera.serving.engine import LLMEngine
from tests.serving_helper import train_tiny_tokenizer

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"


def test_exported_tokenizer_adds_bos_as_the_server_does_and_chat_templates_travel(tmp_path):
    tokenizer = train_tiny_tokenizer(tmp_path)
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, tokenizer=tmp_path / "tokenizer.model")
    export_hf(ckpt, tmp_path / "hf")
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    engine = LLMEngine(model, tokenizer, background=False)
    for text in ["def main(args):", "  two  spaces"]:
        assert hf_tok.encode(text) == engine.encode(text)  # BOS first, as served
        assert hf_tok.encode(text, add_special_tokens=False) == engine.encode(text, add_bos=False)

    # transformers >= 4.43 saves the chat template beside the tokenizer config.
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()
    import_hf(tmp_path / "hf", tmp_path / "imported")
    args = argparse.Namespace(chat_template=None, checkpoint=str(tmp_path / "imported"))
    template, origin = chat_template_of(args)
    assert template == TEMPLATE and "chat_template.jinja" in origin
    export_hf(tmp_path / "imported", tmp_path / "hf2")
    again = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf2")
    assert again.chat_template == TEMPLATE
    assert "built-in" in chat_template_of(argparse.Namespace(chat_template=None,
                                                             checkpoint=str(ckpt)))[1]
