"""BERT Hugging Face import/export against transformers' own `BertForMaskedLM` and
`BertForPreTraining`, built locally with random fp32 weights (every tensor perturbed, so a
swapped or dropped one shows): logits and loss (with padding and token types), the HF round trip
bit for bit, and resharding tp1 -> tp2 -> tp1 bit for bit. Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.cli import main  # noqa: E402
from tessera.converters.hf_io import open_hf_dir  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import CheckpointReader, load_checkpoint  # noqa: E402

VOCAB = 301  # odd: tp2 pads the vocabulary and the decoder bias


def _convert(*argv) -> None:
    assert main([*map(str, argv)]) == 0


@torch.no_grad()
def _hf_model(cls: str):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=64, type_vocab_size=3,
                                     architectures=[cls])
    model = getattr(transformers, cls)(config)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


def _inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=gen)
    types = torch.randint(0, 3, (3, 20), generator=gen)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 14:] = 0  # padding
    mask[2, 5:] = 0
    labels = torch.full_like(ids, -100)
    pick = torch.rand(3, 20, generator=gen) < 0.3
    labels[pick & mask.bool()] = ids[pick & mask.bool()]
    return ids, types, mask, labels


@pytest.fixture(scope="module", params=["BertForMaskedLM", "BertForPreTraining"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    model.save_pretrained(root / "hf")
    _convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return request.param, model, root


def test_logits_and_loss_match_hf(imported):
    cls, hf, root = imported
    model = load_checkpoint(root / "ckpt")
    assert type(model).__name__ == "BertModel"
    assert model.config.options.binary_head == (cls == "BertForPreTraining")
    ids, types, mask, labels = _inputs()
    with torch.no_grad():
        out = hf(ids, token_type_ids=types, attention_mask=mask)
        hf_logits = out.logits if cls == "BertForMaskedLM" else out.prediction_logits
        logits = model(ids, token_types=types, attention_mask=mask)
        keep = mask.bool()  # padded positions' logits are not defined by either model
        assert (hf_logits - logits)[keep].abs().max().item() <= 1e-4
        if cls == "BertForMaskedLM":
            hf_loss = hf(ids, token_type_ids=types, attention_mask=mask, labels=labels).loss
            loss = model(ids, labels, token_types=types, attention_mask=mask)
        else:
            nsp = torch.tensor([0, 1, 1])
            hf_loss = hf(ids, token_type_ids=types, attention_mask=mask, labels=labels,
                         next_sentence_label=nsp).loss
            loss = model(ids, labels, token_types=types, attention_mask=mask, next_sentence=nsp)
    assert abs(hf_loss.item() - loss.item()) <= 1e-5


def test_export_round_trip_and_reshard_are_bit_exact(imported):
    cls, hf, root = imported
    _convert("--to", "hf", "--input", root / "ckpt", "--output", root / "out")
    original, exported = open_hf_dir(root / "hf"), open_hf_dir(root / "out")
    assert exported.names == original.names
    for name in original.names:
        assert torch.equal(exported.read(name), original.read(name)), name
    a = transformers.AutoConfig.from_pretrained(root / "hf").to_dict()
    b = transformers.AutoConfig.from_pretrained(root / "out").to_dict()
    for key in ("_name_or_path", "pad_token_id"):
        a.pop(key, None), b.pop(key, None)
    assert a == b
    # Resharding: tp2 (vocabulary and decoder bias padded), then back to tp1.
    _convert("--input", root / "ckpt", "--output", root / "tp2", "--tp", "2")
    _convert("--input", root / "tp2", "--output", root / "tp1", "--tp", "1")
    before, after = CheckpointReader(root / "ckpt"), CheckpointReader(root / "tp1")
    shard = CheckpointReader(root / "tp2").shard("lm_head.bias", 1, 2)
    assert shard.shape == (151,) and shard[-1] == 0  # the padding row
    for name in before.manifest.weight_map:
        assert torch.equal(before.global_tensor(name), after.global_tensor(name)), name


def test_pretraining_weights_under_a_masked_lm_config_keep_their_head(tmp_path):
    # As the original Hub checkpoints: architectures BertForMaskedLM, weights with the NSP head.
    model = _hf_model("BertForPreTraining")
    model.config.architectures = ["BertForMaskedLM"]
    model.save_pretrained(tmp_path / "hf")
    _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    assert load_checkpoint(tmp_path / "ckpt").config.options.binary_head


def test_unsupported_hf_bert_is_refused():
    with pytest.raises(ConversionError, match="position_embedding_type"):
        config_from_hf({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
                        "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 16, "max_position_embeddings": 8,
                        "position_embedding_type": "relative_key"})


def test_bert_config_refuses_decoder_features():
    from tessera.core.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="position='rope'"):
        ModelConfig.from_name("bert-tiny", position="rope")
