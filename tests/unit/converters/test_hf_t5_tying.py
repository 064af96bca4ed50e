"""T5 as transformers 5 writes it: whether the output is tied to the embedding and whether the
decoder output is scaled by d_model ** -0.5 are two separate facts.

- gated, from an untied config: transformers 5 ties it in memory, stores no `lm_head`, and
  writes `tie_word_embeddings: true, scale_decoder_outputs: false` (tied, unscaled);
- relu, tied config, with an `lm_head` of its own (scaled, untied).
Each imports with transformers' logits, serves greedy tokens equal to `generate`, exports to a
directory transformers loads to the same logits, and keeps them through a tp2 reshard.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import export_hf, import_hf  # noqa: E402
from tessera.converters.hf_mapping import config_from_hf  # noqa: E402
from tessera.converters.reshard import reshard_checkpoint  # noqa: E402
from tessera.core.models.t5.init import load_t5_checkpoint  # noqa: E402
from tessera.serving.engine.t5_engine import T5Engine  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect  # noqa: E402

VOCAB = 99
_BASE = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=20,
             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
KINDS = {
    # (config fields, give lm_head its own weights) -> (tied, scaled) after import
    "gated-tied-unscaled": (dict(_BASE, feed_forward_proj="gated-gelu",
                                 tie_word_embeddings=False), False, (True, False)),
    "relu-untied-scaled": (dict(_BASE, feed_forward_proj="relu", tie_word_embeddings=True),
                           True, (False, True)),
}


@pytest.fixture(scope="module", params=list(KINDS))
def imported(request, tmp_path_factory):
    kind, root = request.param, tmp_path_factory.mktemp(request.param)
    fields, own_head, _ = KINDS[kind]
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))
    with torch.no_grad():
        if own_head:
            hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, fields["d_model"]))
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return kind, hf.float().eval(), root


def _batch():
    gen = torch.Generator().manual_seed(1)
    enc = torch.randint(2, VOCAB, (2, 11), generator=gen)
    dec = torch.cat([torch.zeros(2, 1, dtype=torch.long),
                     torch.randint(2, VOCAB, (2, 6), generator=gen)], dim=1)
    return enc, dec


@torch.no_grad()
def _logit_diff(hf, ours) -> float:
    enc, dec = _batch()
    want = hf(input_ids=enc, decoder_input_ids=dec).logits
    return (ours(enc, decoder_input_ids=dec) - want).abs().max().item()


def test_files_and_import_keep_the_two_facts_apart(imported):
    kind, hf, root = imported
    _, own_head, (tied, scaled) = KINDS[kind]
    saved = json.loads((root / "hf" / "config.json").read_text())
    assert (saved["tie_word_embeddings"], saved["scale_decoder_outputs"]) == (True, scaled)
    index = (root / "hf" / "model.safetensors").read_bytes()[:20000]
    assert (b"lm_head.weight" in index) == own_head
    ours = load_t5_checkpoint(str(root / "ckpt"))
    assert (ours.config.tied_embeddings, ours.config.options.scaled_output) == (tied, scaled)
    assert _logit_diff(hf, ours) <= 1e-4, kind


def test_greedy_serving_equals_generate(imported):
    kind, hf, root = imported
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.generate(input_ids=prompt, max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    engine = T5Engine(load_t5_checkpoint(str(root / "ckpt")))  # no EOS: never stops early
    got = collect(engine, [GenerationRequest("r", prompt[0].tolist(), SamplingParams(
        max_tokens=16, temperature=0))])[0].token_ids
    assert got == want[0, 1:].tolist()  # HF's row starts with the decoder start token


def test_export_writes_both_facts_and_transformers_loads_it(imported):
    kind, hf, root = imported
    _, own_head, (tied, scaled) = KINDS[kind]
    export_hf(root / "ckpt", root / "out", overwrite=True)
    config = json.loads((root / "out" / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["scale_decoder_outputs"]) == (tied, scaled)
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(root / "out").eval()
    assert reloaded.config.scale_decoder_outputs == scaled
    enc, dec = _batch()
    with torch.no_grad():
        a = reloaded(input_ids=enc, decoder_input_ids=dec).logits
        b = hf(input_ids=enc, decoder_input_ids=dec).logits
    assert (a - b).abs().max().item() <= 1e-4, kind


def test_tp2_reshard_keeps_the_logits(imported):
    kind, hf, root = imported
    reshard_checkpoint(root / "ckpt", root / "tp2", tp=2, progress=False)
    assert _logit_diff(hf, load_t5_checkpoint(str(root / "tp2"))) <= 1e-4, kind


def test_v4_configs_read_tied_and_scaled_from_one_flag():
    v4 = transformers.T5Config(**_BASE).to_dict()
    v4.pop("scale_decoder_outputs")
    for flag in (True, False):
        c = config_from_hf({**v4, "tie_word_embeddings": flag})
        assert (c.tied_embeddings, c.options.scaled_output) == (flag, flag)
