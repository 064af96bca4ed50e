"""T5 checkpoints reshard like any other: tp1 -> tp2 x pp2 (encoder on pp rank 0, decoder on 1)
-> tp1 is bit-exact, each target file holds what its rank's stage holds (the decoder stage's
embedding copy is read from the encoder stage's files, never stored twice), and the resharded
checkpoint gives the same logits."""

from __future__ import annotations

import torch
from safetensors import safe_open

from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint import CheckpointReader, save_checkpoint
from tessera.core.config import ModelConfig
from tessera.core.models.t5.init import build_t5_model, load_t5_checkpoint


def test_t5_reshards_bit_exactly_and_by_stage(tmp_path):
    config = ModelConfig.from_name("t5-tiny", vocab_size=101, hidden_size=32,
                                   ffn_hidden_size=64)
    model = build_t5_model(config, seed=5).eval()
    save_checkpoint(tmp_path / "a", model)
    reshard_checkpoint(tmp_path / "a", tmp_path / "b", tp=2, pp=2, progress=False)
    reshard_checkpoint(tmp_path / "b", tmp_path / "c", tp=1, pp=1, progress=False)
    a, c = CheckpointReader(tmp_path / "a"), CheckpointReader(tmp_path / "c")
    for name in a.names():
        assert torch.equal(a.global_tensor(name), c.global_tensor(name)), name
    for tp in range(2):
        with safe_open(str(tmp_path / "b" / f"model-tp{tp:02d}-pp00.safetensors"), "pt") as f:
            first = set(f.keys())
        with safe_open(str(tmp_path / "b" / f"model-tp{tp:02d}-pp01.safetensors"), "pt") as f:
            second = set(f.keys())
        assert "tok_embeddings.weight" in first and "tok_embeddings.weight" not in second
        assert all(n.startswith("decoder.") or n == "output.weight" for n in second)
        assert all(n.startswith("encoder.") or n == "tok_embeddings.weight" for n in first)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    dec = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(1))
    resharded = load_t5_checkpoint(str(tmp_path / "b"))
    with torch.no_grad():
        assert torch.equal(model(ids, decoder_input_ids=dec),
                           resharded(ids, decoder_input_ids=dec))
