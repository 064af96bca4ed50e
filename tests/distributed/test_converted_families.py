"""Converted Hugging Face models run under tp2 on gloo with the logits of one process: Qwen2
(its q/k/v biases split with their heads) and Llama with longrope (length-dependent
frequencies, a prompt past the original length)."""

import pytest
import torch

from tessera.converters.hf_io import import_hf
from tessera.converters.reshard import reshard_checkpoint
from tessera.core import Layout, build_model, load_checkpoint
from tessera.core.checkpoint import load_weights, read_manifest
from tessera.core.parallel.groups import init_groups
from tests.distributed_helper import run_ranks

transformers = pytest.importorskip("transformers")

VOCAB = 256
IDS = torch.arange(2 * 24).reshape(2, 24) * 37 % VOCAB
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
               initializer_range=0.1)
MODELS = {
    "qwen2": ("Qwen2Config", dict(_COMMON, tie_word_embeddings=True)),
    "longrope": ("LlamaConfig", dict(_COMMON, rope_parameters=dict(
        rope_type="longrope", original_max_position_embeddings=16, rope_theta=10000.0,
        short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.5, 5.0, 9.0]))),
}


def _tp_logits(rank: int, world: int, path: str):
    manifest = read_manifest(path)
    groups = init_groups(Layout(tp=2))
    model = build_model(manifest.model, Layout(tp=2), groups, init=False)
    load_weights([model], path)
    with torch.no_grad():
        return model.eval()(IDS).detach()


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_model_under_tp2_matches_one_process(tmp_path, name):
    cls, fields = MODELS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf")
    src = import_hf(tmp_path / "hf", tmp_path / "tp1")
    with torch.no_grad():
        reference = load_checkpoint(src)(IDS)
        assert (hf.eval()(IDS).logits - reference).abs().max() <= 1e-4
    reshard_checkpoint(src, tmp_path / "tp2", tp=2, progress=False)
    for logits in run_ranks(_tp_logits, 2, str(tmp_path / "tp2"), timeout=120):
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
