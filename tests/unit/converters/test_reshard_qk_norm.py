"""Checkpoints of a model with Qwen3's per-head q/k norm (`ModelConfig.qk_norm`) reshard like
any other: the `(head_dim,)` norm weights are replicated on every tp rank and placed with their
layer's pipeline stage; every hop is bit-exact and the logits do not change, including at tp 4
with the 2 kv heads replicated."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint import load_checkpoint, save_checkpoint
from tessera.core.config import ModelConfig

from .ckpt_factory import assert_rank_files, global_tensors, make_checkpoint

CONFIG = ModelConfig(name="qk-norm-test", vocab_size=1003, hidden_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=24, ffn_hidden_size=128,
                     max_position_embeddings=64, qk_norm=True)


def test_qk_norm_checkpoints_reshard_bit_exactly(tmp_path):
    model = load_checkpoint(make_checkpoint(tmp_path / "orig", CONFIG, seed=3))
    assert model.layers["3"].attention.k_norm.weight.shape == (24,)
    with torch.no_grad():  # norm weights start at 1: make them distinct per layer and tensor
        for name, p in model.named_parameters():
            if name.endswith("_norm.weight"):
                p.add_(torch.randn_like(p))
    src = save_checkpoint(tmp_path / "perturbed", model)
    original = global_tensors(src)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_checkpoint(src)(ids)
    for tp, pp, vs in [(2, 2, 1), (4, 1, 1), (2, 2, 2)]:
        dst = Path(reshard_checkpoint(src, tmp_path / f"tp{tp}pp{pp}vs{vs}", tp=tp, pp=pp,
                                      virtual_stages=vs, progress=False).destination)
        got = global_tensors(dst)
        assert got.keys() == original.keys()
        assert all(torch.equal(got[n], t) for n, t in original.items())
        assert_rank_files(dst, original, CONFIG, tp, pp, vs)
        with torch.no_grad():
            assert torch.equal(load_checkpoint(dst)(ids), want)
