"""Tiny checkpoints for the converter tests, and an independent statement of who stores what."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tessera.core import Layout, ModelConfig, build_model
from tessera.core.checkpoint import CheckpointReader, save_checkpoint, shard_file_name
from tessera.core.parallel.sharding import (
    global_param_shapes,
    shard_tensor,
    stage_ids,
    stage_layers,
    stored_shard,
)

CONFIGS = {
    # Grouped-query attention (8 heads, 4 kv heads), untied output, vocabulary needing padding.
    "gqa": ModelConfig(name="gqa-test", vocab_size=1003, hidden_size=64, num_layers=4, num_heads=8,
                       num_kv_heads=4, ffn_hidden_size=128, max_position_embeddings=64),
    # GPT-2 style: tied embeddings, learned positions, biases, LayerNorm.
    "tied": ModelConfig.from_name("gpt2-tiny", vocab_size=1003, num_layers=4,
                                  max_position_embeddings=64),
}


def make_checkpoint(path: Path, config: ModelConfig, seed: int = 0,
                    dtype: torch.dtype = torch.float32, **kwargs) -> Path:
    return save_checkpoint(path, build_model(config, seed=seed, dtype=dtype), **kwargs)


def global_tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {name: reader.global_tensor(name) for name in reader.names()}


def expected_files(config: ModelConfig, tp: int, pp: int, vs: int, placement: str = "looped"
                   ) -> dict[str, set[str]]:
    """file -> global names it must hold, derived from stage placement and split rules alone."""
    n_stages = pp * vs
    owner = {}
    layout = Layout(tp=tp, pp=pp, virtual_stages=vs, placement=placement)
    for p in range(pp):
        for s in stage_ids(layout, p):
            for i in stage_layers(s, n_stages, config.num_layers):
                owner[i] = p
            if s == 0:
                owner["first"] = p
            if s == n_stages - 1:
                owner["last"] = p
    out: dict[str, set[str]] = {shard_file_name(t, p): set() for t in range(tp) for p in range(pp)}
    for name in global_param_shapes(config):
        m = re.match(r"layers\.(\d+)\.", name)
        p = owner[int(m.group(1))] if m else owner["first" if "embeddings" in name else "last"]
        for t in range(tp):  # replicated tensors too: each rank reads only its own file
            out[shard_file_name(t, p)].add(name)
    return out


def assert_rank_files(path: Path, original: dict[str, torch.Tensor], config: ModelConfig,
                      tp: int, pp: int, vs: int = 1, placement: str = "looped") -> None:
    """Each rank's file holds exactly that rank's shards, equal to `shard_tensor` of the original
    (in their stored form: a replicated kv head only in the first file of its replica group)."""
    from safetensors import safe_open

    expected = expected_files(config, tp, pp, vs, placement)
    assert sorted(p.name for p in path.glob("*.safetensors")) == sorted(expected)
    for file, names in expected.items():
        t = int(file.split("-tp")[1][:2])
        with safe_open(str(path / file), "pt") as fh:
            stored = {k for k in fh.keys() if not k.endswith(".scale")}
            assert stored == names, file
            for name in names:
                want = stored_shard(name, shard_tensor(name, original[name], config, t, tp),
                                    config, t, tp)
                assert torch.equal(fh.get_tensor(name), want), (file, name)
