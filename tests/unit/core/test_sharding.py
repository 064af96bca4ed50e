"""The one-place sharding rules, checked with fake ranks (no processes)."""

import pytest
import torch

from tessera.core import Layout, ModelConfig, build_model
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    global_param_shapes,
    kv_replicas,
    local_kv_heads,
    local_shape,
    padded_vocab_size,
    replica_rows,
    shard_columns,
    shard_row_ranges,
    shard_spec,
    shard_tensor,
    stage_ids,
    stage_layers,
    stored_shape,
    stored_shard,
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
            for stored in (False, True):  # the model's local form and the checkpoint's form
                got = torch.zeros(stored_shape(name, config, r, tp, stored=stored))
                for a, b, local in shard_row_ranges(name, config, r, tp, stored=stored):
                    piece = full[a:b] if cols is None else full[a:b, cols[0]:cols[1]]
                    got[local:local + b - a] = piece
                    seen[a:b] += stored  # stored rows: every global row once, kv heads too
                expect = stored_shard(name, want, config, r, tp) if stored else want
                assert torch.equal(got, expect), (name, r, stored)
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


# kv-head replication: tp larger than num_kv_heads (Megatron's layout).
def _kv_config(**kw) -> ModelConfig:
    return ModelConfig.from_name("llama-tiny", ffn_hidden_size=128, vocab_size=1003, **kw)


KV_REPLICATED = {
    "kv2-tp4": (_kv_config(num_heads=8, num_kv_heads=2), 4),
    "kv4-tp8": (_kv_config(num_heads=8, num_kv_heads=4, bias=True), 8),
    "kv1-tp4": (_kv_config(num_heads=4, num_kv_heads=1), 4),
}


def _head_ids(config: ModelConfig, name: str) -> torch.Tensor:
    """A global tensor whose every row holds its own global row index."""
    shape = global_param_shapes(config)[name]
    rows = torch.arange(shape[0]).float()
    return rows.unsqueeze(1).expand(shape).contiguous() if len(shape) == 2 else rows


@pytest.mark.parametrize("case", KV_REPLICATED)
def test_each_rank_holds_its_query_heads_and_the_one_kv_head_they_use(case):
    config, tp = KV_REPLICATED[case]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    rep = tp // nkv
    assert kv_replicas(config, tp) == rep and local_kv_heads(config, tp) == 1
    for leaf in ("weight", "bias") if config.bias else ("weight",):
        name = f"layers.1.attention.wqkv.{leaf}"
        full = _head_ids(config, name)
        for r in range(tp):
            rows = shard_tensor(name, full, config, r, tp)
            if rows.dim() == 2:
                rows = rows[:, 0]
            q_heads = range(r * nh // tp, (r + 1) * nh // tp)
            kv = r // rep  # the kv head of those query heads under grouped-query attention
            assert all(h // (nh // nkv) == kv for h in q_heads)
            q = [h * hd + i for h in q_heads for i in range(hd)]
            k = [nh * hd + kv * hd + i for i in range(hd)]
            v = [(nh + nkv) * hd + kv * hd + i for i in range(hd)]
            assert rows.long().tolist() == q + k + v, (name, r)
            assert replica_rows(name, config, tp) == [(len(q), len(q) + hd),
                                                      (len(q) + hd, len(q) + 2 * hd)]
            # Stored form: the kv rows only on the first rank of each replica group.
            kept = stored_shard(name, shard_tensor(name, full, config, r, tp), config, r, tp)
            assert kept.shape == stored_shape(name, config, r, tp)
            assert kept.shape[0] == len(q) + (2 * hd if r % rep == 0 else 0)


@pytest.mark.parametrize("case", KV_REPLICATED)
def test_replicated_kv_heads_unshard_from_either_form_and_are_stored_once(case):
    config, tp = KV_REPLICATED[case]
    Layout(tp=tp).validate(config)
    for name, shape in global_param_shapes(config).items():
        full = torch.randn(shape)
        local = [shard_tensor(name, full, config, r, tp) for r in range(tp)]
        assert all(s.shape == local_shape(name, config, tp) for s in local), name
        stored = [stored_shard(name, s, config, r, tp) for r, s in enumerate(local)]
        assert torch.equal(unshard_tensors(name, local, config), full), name
        assert torch.equal(unshard_tensors(name, stored, config), full), name
        if shard_spec(name, config).dim == 0 and not shard_spec(name, config).vocab:
            # Every global row (each kv head too) is stored exactly once over the ranks.
            assert sum(s.shape[0] for s in stored) == shape[0], name
    assert replica_rows("layers.0.attention.wqkv.weight", config, 1) == []
    assert replica_rows("layers.0.feed_forward.w1.weight", config, tp) == []


@pytest.mark.parametrize("case", KV_REPLICATED)
def test_model_under_kv_replication_has_the_rules_shapes(case):
    config, tp = KV_REPLICATED[case]
    groups = ParallelGroups(tp_rank=tp - 1, tp_size=tp)
    model = build_model(config, Layout(tp=tp), groups, seed=3)
    reference = build_model(config, seed=3)
    full = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, shard_tensor(name, full[name].detach(), config, tp - 1, tp)), name
    assert model.layers["0"].attention.n_kv == 1
