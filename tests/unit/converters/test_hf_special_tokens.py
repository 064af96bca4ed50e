"""`tessera convert --to hf` writes the tokenizer's special-token ids (BOS, EOS and PAD) into
config.json and generation_config.json, and transformers, offline, loads the same ids from the
config and from the exported tokenizer."""

from __future__ import annotations

import json

import pytest
import transformers

from tessera.converters.hf_io import export_hf
from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tests.serving_helper import train_tiny_tokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-special")
    tokenizer = train_tiny_tokenizer(tmp)
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    ckpt = save_checkpoint(tmp / "ckpt", model, tokenizer=tmp / "tokenizer.model")
    return tokenizer, export_hf(ckpt, tmp / "hf")


def test_config_names_the_tokenizers_pad_bos_and_eos(exported):
    tokenizer, hf = exported
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_id,
           "eos_token_id": tokenizer.eos_id}
    assert None not in ids.values() and len(set(ids.values())) == 3, ids  # all distinct
    config = transformers.AutoConfig.from_pretrained(hf)
    assert {k: getattr(config, k) for k in ids} == ids
    generation = json.loads((hf / "generation_config.json").read_text())
    assert {k: generation[k] for k in ids} == ids


def test_exported_tokenizer_has_the_same_special_tokens(exported):
    tokenizer, hf = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.bos_id, tokenizer.eos_id)
