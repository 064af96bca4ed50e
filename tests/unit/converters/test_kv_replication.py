"""Checkpoints and resharding with kv heads replicated over tp ranks (tp > num_kv_heads).

The weights of each kv head are stored once, by the first rank of its replica group (checked on
the stored bytes), every layout round trip is bit-exact, and every rank of the layout loads its
full local shard (the replicated kv head included) from the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tessera.converters import reshard as reshard_mod
from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint import (
    MANIFEST,
    CheckpointReader,
    Manifest,
    _merge_weight_maps,
    load_checkpoint,
    load_weights,
    read_manifest,
    shard_file_name,
    write_weights,
)
from tessera.core.config import Layout, ModelConfig
from tessera.core.init import build_model
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    global_param_shapes,
    kv_replicas,
    shard_scale,
    shard_tensor,
    stored_shard,
)

from .ckpt_factory import assert_rank_files, global_tensors, make_checkpoint


def _config(num_kv_heads: int) -> ModelConfig:
    return ModelConfig(name=f"kv{num_kv_heads}", vocab_size=1003, hidden_size=64, num_layers=4,
                       num_heads=8, num_kv_heads=num_kv_heads, ffn_hidden_size=128,
                       max_position_embeddings=64)


# (num_kv_heads, chain of (tp, pp)); every hop past tp = num_kv_heads replicates kv heads.
CHAINS = {
    "kv2": (2, [(4, 1), (1, 1), (4, 2), (2, 1), (8, 1), (1, 1)]),
    "kv4": (4, [(8, 1), (2, 1), (8, 2), (4, 1), (1, 1)]),
}
QKV = "layers.{}.attention.wqkv.weight"


def _assert_each_kv_head_stored_once(path: Path, config: ModelConfig, tp: int) -> None:
    """Over the files of the checkpoint, the wqkv bytes are exactly the global tensor's: each
    query head and each kv head once; replica ranks after the first hold query rows only."""
    manifest = read_manifest(path)
    hd, nq = config.head_dim, config.num_heads
    rep = kv_replicas(config, tp)
    for layer in range(config.num_layers):
        name = QKV.format(layer)
        files = manifest.weight_map[name]
        assert len(files) == tp
        stored_bytes = 0
        for t, file in enumerate(files):
            with safe_open(str(path / file), "pt") as fh:
                rows = fh.get_tensor(name)
            stored_bytes += rows.nbytes
            kv_rows = 2 * hd * max(1, config.num_kv_heads // tp)
            assert rows.shape[0] == nq * hd // tp + (kv_rows if t % rep == 0 else 0), (file, t)
        assert stored_bytes == torch.Size(global_param_shapes(config)[name]).numel() * 4


@pytest.mark.parametrize("chunk_bytes", [None, 600], ids=["whole", "row-chunks"])
@pytest.mark.parametrize("chain", CHAINS)
def test_round_trips_through_replicated_layouts_are_bit_exact(chain, chunk_bytes, tmp_path,
                                                              monkeypatch):
    if chunk_bytes:
        monkeypatch.setattr(reshard_mod, "CHUNK_BYTES", chunk_bytes)
    num_kv, hops = CHAINS[chain]
    config = _config(num_kv)
    src = make_checkpoint(tmp_path / "orig", config, seed=7)
    original = global_tensors(src)
    for i, (tp, pp) in enumerate(hops):
        dst = tmp_path / f"hop{i}-tp{tp}-pp{pp}"
        reshard_checkpoint(src, dst, tp=tp, pp=pp, progress=False)
        got = global_tensors(dst)
        assert all(torch.equal(got[n], t) for n, t in original.items()), dst.name
        assert_rank_files(dst, original, config, tp, pp)
        _assert_each_kv_head_stored_once(dst, config, tp)
        src = dst
    with safe_open(str(src / shard_file_name(0, 0)), "pt") as a, \
            safe_open(str(tmp_path / "orig" / shard_file_name(0, 0)), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_every_rank_loads_its_replicated_kv_head(tmp_path, monkeypatch):
    """A replica rank after the first reads its own file and the first rank's (for the kv
    rows); every parameter equals `shard_tensor` of the original, and the logits are equal."""
    config, tp = _config(2), 4
    src = make_checkpoint(tmp_path / "orig", config, seed=8)
    original = global_tensors(src)
    dst = reshard_checkpoint(src, tmp_path / "tp4", tp=tp, progress=False).destination
    opened: list[str] = []
    real_open = CheckpointReader._open
    monkeypatch.setattr(CheckpointReader, "_open",
                        lambda self, f: (opened.append(f), real_open(self, f))[1])
    for t in range(tp):
        model = build_model(config, Layout(tp=tp), ParallelGroups(tp_rank=t, tp_size=tp),
                            init=False)
        opened.clear()
        load_weights(model, dst)
        first = t - t % kv_replicas(config, tp)
        assert set(opened) == {shard_file_name(t, 0), shard_file_name(first, 0)}, (t, opened)
        for name, p in model.named_parameters():
            assert torch.equal(p, shard_tensor(name, original[name], config, t, tp)), (t, name)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(dst)(ids), load_checkpoint(src)(ids))


def test_rank_writes_store_each_kv_head_once_and_load_under_any_layout(tmp_path):
    """What `save_checkpoint` does on each rank of tp 8 (its `write_weights`, then the merged
    weight map), with fake ranks: the files hold each kv head once and load under tp 1, 2, 8."""
    config, tp = _config(4), 8
    reference = build_model(config, seed=9)
    directory = tmp_path / "tp8"
    directory.mkdir()
    maps = []
    for t in range(tp):
        model = build_model(config, Layout(tp=tp), ParallelGroups(tp_rank=t, tp_size=tp),
                            seed=9)
        maps.append(write_weights(directory, [model]))
    manifest = Manifest(model=config, layout=Layout(tp=tp),
                        weight_map=_merge_weight_maps(maps, reference))
    (directory / MANIFEST).write_text(manifest.to_json())
    _assert_each_kv_head_stored_once(directory, config, tp)
    want = dict(reference.named_parameters())
    assert all(torch.equal(t, want[n]) for n, t in global_tensors(directory).items())
    for t_size in (1, 2, 8):
        for t in range(t_size):
            model = build_model(config, Layout(tp=t_size),
                                ParallelGroups(tp_rank=t, tp_size=t_size), init=False)
            load_weights(model, directory)
            for name, p in model.named_parameters():
                assert torch.equal(p, shard_tensor(name, want[name].detach(), config, t, t_size))
    assert json.loads((directory / MANIFEST).read_text())["layout"]["tp"] == tp


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_scales_follow_the_stored_rows(per_channel, tmp_path):
    from tessera.core.fp8 import quantize

    config, tp = _config(2), 4
    src = make_checkpoint(tmp_path / "orig", config, seed=10, dtype=torch.bfloat16)
    original = global_tensors(src)
    fp8 = reshard_checkpoint(src, tmp_path / "fp8", tp=tp, fp8=True, fp8_per_channel=per_channel,
                             progress=False).destination
    reader = CheckpointReader(fp8)
    name = QKV.format(0)
    q, scale = quantize(original[name], per_channel)
    for t, file in enumerate(reader.manifest.weight_map[name]):
        want = stored_shard(name, shard_tensor(name, q, config, t, tp), config, t, tp)
        assert torch.equal(reader._get(file, name), want)
        want_scale = stored_shard(name, shard_scale(name, scale, config, t, tp), config, t, tp)
        assert torch.equal(reader._get(file, name + ".scale"), want_scale)
    raw = {n: reader.raw_shards(n) for n in reader.names()}
    back = reshard_checkpoint(fp8, tmp_path / "tp1", tp=1, progress=False).destination
    again = reshard_checkpoint(back, tmp_path / "tp4", tp=tp, progress=False).destination
    for n, shards in raw.items():
        assert all(torch.equal(a, b) for a, b in
                   zip(CheckpointReader(again).raw_shards(n), shards, strict=True)), n
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        single = load_checkpoint(fp8)(ids)
        for t in range(tp):
            model = build_model(config, Layout(tp=tp),
                                ParallelGroups(tp_rank=t, tp_size=tp), init=False,
                                dtype=torch.bfloat16)
            load_weights(model, fp8)
            full = dict(load_checkpoint(fp8).named_parameters())
            for n, p in model.named_parameters():
                assert torch.equal(p, shard_tensor(n, full[n].detach(), config, t, tp)), n
    assert single.shape == (2, 12, config.vocab_size)
