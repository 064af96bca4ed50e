"""The one-place sharding rules, checked with fake ranks (no processes)."""

import pytest
import torch

from tessera.core import Layout, ModelConfig, build_model
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    global_param_shapes,
    local_shape,
    padded_vocab_size,
    shard_columns,
    shard_row_ranges,
    shard_spec,
    shard_tensor,
    stage_ids,
    stage_layers,
    unshard_tensors,
)

CONFIGS = {
    "gpt2": ModelConfig.from_name("gpt2-tiny", vocab_size=1003),
    "llama-gqa": ModelConfig.from_name("llama-tiny", vocab_size=1003, num_heads=8,
                                       num_kv_heads=4, ffn_hidden_size=128),
    "nemotron": ModelConfig.from_name("nemotron-tiny"),
}


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip_is_exact(family, tp):
    config = CONFIGS[family]
    for name, shape in global_param_shapes(config).items():
        full = torch.randn(shape)
        shards = [shard_tensor(name, full, config, r, tp) for r in range(tp)]
        assert all(s.shape == local_shape(name, config, tp) for s in shards), name
        assert torch.equal(unshard_tensors(name, shards, config), full), name


ROW_CONFIGS = {
    **CONFIGS,
    "gpt2-untied": ModelConfig.from_name("gpt2-tiny", vocab_size=1003, tied_embeddings=False),
    "tiny-vocab": ModelConfig.from_name("llama-tiny", vocab_size=5, num_heads=4, num_kv_heads=4),
}


@pytest.mark.parametrize("family", ROW_CONFIGS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_ranges_and_columns_rebuild_every_shard(family, tp):
    """The chunked converters' form of the rules gives exactly `shard_tensor`'s shards: each
    shard assembled from its row ranges and column slice, zeros elsewhere, and the ranges of all
    ranks cover every global row exactly once (what `unshard_tensors` returns)."""
    config = ROW_CONFIGS[family]
    for name, shape in global_param_shapes(config).items():
        full = torch.randn(shape)
        seen = torch.zeros(shape[0], dtype=torch.long)
        for r in range(tp):
            want = shard_tensor(name, full, config, r, tp)
            cols = shard_columns(name, config, r, tp, shape[-1]) if len(shape) == 2 else None
            got = torch.zeros(local_shape(name, config, tp))
            for a, b, local in shard_row_ranges(name, config, r, tp):
                piece = full[a:b] if cols is None else full[a:b, cols[0]:cols[1]]
                got[local:local + b - a] = piece
                seen[a:b] += 1
            assert torch.equal(got, want), (name, r)
        replicas = 1 if shard_spec(name, config).dim == 0 else tp
        assert torch.equal(seen, torch.full_like(seen, replicas)), name


def test_vocab_padding_is_zero_and_never_returned():
    config = CONFIGS["gpt2"]
    assert padded_vocab_size(1003, 4) == 1004
    full = torch.randn(1003, config.hidden_size)
    last = shard_tensor("tok_embeddings.weight", full, config, 3, 4)
    assert last.shape[0] == 251 and torch.all(last[-1] == 0)


def test_fused_qkv_under_gqa_gives_each_rank_its_own_heads():
    config = CONFIGS["llama-gqa"]  # 8 query heads, 4 kv heads, head_dim 8
    hd, nq, nkv = config.head_dim, 8, 4
    rows = torch.arange((nq + 2 * nkv) * hd).float().unsqueeze(1).expand(-1, config.hidden_size)
    shard = shard_tensor("layers.0.attention.wqkv.weight", rows, config, 1, 2)[:, 0].long()
    q = list(range(4 * hd, 8 * hd))  # query heads 4-7
    k = list(range(nq * hd + 2 * hd, nq * hd + 4 * hd))  # kv heads 2-3 of k
    v = list(range((nq + nkv) * hd + 2 * hd, (nq + nkv) * hd + 4 * hd))
    assert shard.tolist() == q + k + v


def test_fused_gate_up_split_separately():
    config = ModelConfig.from_name("llama-tiny", ffn_hidden_size=4, hidden_size=8, num_heads=2,
                                   num_kv_heads=2)
    full = torch.arange(8).float().unsqueeze(1).expand(-1, 8)  # [gate 0-3; up 4-7]
    shard = shard_tensor("layers.0.feed_forward.w1.weight", full, config, 1, 2)[:, 0]
    assert shard.tolist() == [2, 3, 6, 7]


def test_stage_partitions():
    assert stage_ids(Layout(pp=4, virtual_stages=2), 1) == [1, 5]
    assert stage_ids(Layout(pp=2, virtual_stages=2, placement="v"), 0) == [0, 3]
    assert stage_ids(Layout(pp=2, virtual_stages=2, placement="v"), 1) == [1, 2]
    covered = [i for s in range(8) for i in stage_layers(s, 8, 16)]
    assert covered == list(range(16))


@pytest.mark.parametrize("family", CONFIGS)
def test_model_parameter_shapes_follow_the_rules(family):
    config = CONFIGS[family]
    tp = 2 if family != "nemotron" else 2
    model = build_model(config, Layout(tp=tp), ParallelGroups(tp_rank=1, tp_size=tp),
                        init=False)
    for local_name, p in model.named_parameters():
        assert tuple(p.shape) == local_shape(model.global_name(local_name), config, tp)
