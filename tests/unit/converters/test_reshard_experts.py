"""`tessera convert --ep/--etp`: expert banks resharded between whole banks and expert-grid
pieces of any ep x etp, streaming and bit-exact.

References nobody here wrote the converter against: `sharding.shard_expert_tensor` (what a
rank of a layout holds), the checkpoint writer of a training run (`core.expert_checkpoint.
write_expert_weights` with `safetensors.save_file`, called per simulated rank of the target
layout in one process), and `load_checkpoint` / `load_weights` (how training and serving read).
A real two-rank ep2 training run's checkpoint is converted in `test_moe_pretrain_ep.py`
(`tests/distributed/_expert_convert.py`)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from tessera.converters import reshard as reshard_mod
from tessera.converters.reshard import reshard_checkpoint
from tessera.core import Layout, ModelConfig, build_model
from tessera.core.checkpoint import (
    CheckpointReader,
    load_checkpoint,
    load_weights,
    read_manifest,
    save_checkpoint,
)
from tessera.core.config import ConfigError
from tessera.core.expert_checkpoint import expert_file_name, write_expert_weights
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    expert_global_shape,
    expert_piece,
    is_expert_param,
    shard_expert_tensor,
    stage_ids,
)

MIXTRAL = ModelConfig.from_name("mixtral-tiny")  # 4 experts of FFN 128, gated, 2 layers
QWEN = ModelConfig.from_name("qwen-moe-tiny")  # 8 experts of FFN 32, shared expert


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _global_bytes(path: Path) -> dict[str, bytes]:
    reader = CheckpointReader(path)
    return {n: _bytes(reader.global_tensor(n)) for n in reader.names()}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-process mixtral-tiny checkpoint (whole banks) and the model's state."""
    model = build_model(MIXTRAL, seed=5)
    path = save_checkpoint(tmp_path_factory.mktemp("moe") / "single", model)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("config", [MIXTRAL, QWEN], ids=["mixtral", "qwen"])
def test_expert_piece_is_the_row_range_form_of_shard_expert_tensor(config):
    for name in ("layers.0.feed_forward.experts.w1", "layers.0.feed_forward.experts.w2"):
        full = torch.randn(expert_global_shape(name, config))
        for ep, etp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4)):
            for e in range(ep):
                for t in range(etp):
                    piece = expert_piece(name, config, e, ep, t, etp)
                    cols = slice(*piece.cols) if piece.cols else slice(None)
                    rows = [full[piece.experts[0]:piece.experts[1], a:b, cols]
                            for a, b, _ in piece.rows]
                    want = shard_expert_tensor(name, full, config, e, ep, t, etp)
                    assert torch.equal(torch.cat(rows, dim=1), want), (name, ep, etp, e, t)
                    assert [loc for *_, loc in piece.rows] == [
                        sum(b - a for a, b, _ in piece.rows[:i]) for i in range(len(piece.rows))]



def test_flat_rows_address_an_expert_bank_row_by_row(tmp_path):
    """`(E, R, C)` viewed as `(E * R, C)`: rows of one expert, or across experts, in any order,
    read back by the safetensors library; overlaps, overruns and missing rows are refused."""
    from safetensors.torch import load_file

    from tessera.converters.safetensors_stream import SafetensorsFile, SafetensorsWriter

    path = tmp_path / "bank.safetensors"
    bank = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)
    flat = bank.reshape(12, 5)
    with SafetensorsWriter(path, [("w", torch.float32, (3, 4, 5))]) as w:
        w.write_flat_rows("w", 6, flat[6:])  # expert 1's last two rows and expert 2
        w.write_flat_rows("w", 0, flat[:6])
        with pytest.raises(ValueError, match="twice"):
            w.write_flat_rows("w", 5, flat[5:6])
    assert torch.equal(load_file(str(path))["w"], bank)
    reader = SafetensorsFile(path)
    assert torch.equal(reader.read_flat_rows_into("w", 3, torch.empty(4, 5)), flat[3:7])
    for bad in (torch.empty(4, 5), torch.empty(1, 4)):
        with pytest.raises(ValueError, match="cannot read flat rows"):
            reader.read_flat_rows_into("w", 10 if bad.shape[1] == 5 else 0, bad)
    reader.close()
    w = SafetensorsWriter(path, [("w", torch.float32, (3, 4, 5))])
    with pytest.raises(ValueError, match="do not fit"):
        w.write_flat_rows("w", 11, flat[:2])
    w.write_flat_rows("w", 0, flat[:11])
    with pytest.raises(ValueError, match="never written"):
        w.close()

def _trained_pieces(src: Path, dst: Path, layout: Layout, out: Path) -> dict[str, bytes]:
    """What each expert-grid rank of a training run of `layout` writes, simulated rank by rank
    in this process: build its chunks, load `src` into them (`load_weights`, as a resume), and
    write its pieces (`write_expert_weights`, as `save_checkpoint`); file -> bytes. Each rank
    also loads the converted `dst` (its own piece file: same ep and etp) and must get the
    same parameters, bit for bit."""
    out.mkdir()
    config = read_manifest(src).model
    for p in range(layout.pp):
        for e in range(layout.ep):
            for t in range(layout.etp):
                g = ParallelGroups(pp_rank=p, pp_size=layout.pp, ep_rank=e,
                                   ep_size=layout.ep, etp_rank=t, etp_size=layout.etp)
                chunks, again = ([build_model(config, layout, g, stage_id=s,
                                              num_stages=layout.num_stages, init=False)
                                  for s in stage_ids(layout, p)] for _ in range(2))
                load_weights(chunks, src)
                load_weights(again, dst)
                for a, b in zip(chunks, again, strict=True):
                    want, got = a.state_dict(), b.state_dict()
                    assert all(_bytes(got[k]) == _bytes(v) for k, v in want.items()), (e, t, p)
                write_expert_weights(out, chunks)
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def _check_pieces_like_training(dst: Path, src: Path, tmp: Path) -> None:
    """Every expert piece file of `dst` is byte for byte what training under its layout
    writes, each rank of that layout loads it, and the weight map lists the pieces as
    `save_checkpoint` does (sorted, ep-major)."""
    man = read_manifest(dst)
    lay = man.layout
    trained = _trained_pieces(src, dst, lay, tmp)
    converted = {f.name: f.read_bytes() for f in sorted(dst.glob("experts-*"))}
    assert converted.keys() == trained.keys() and converted, (sorted(converted), sorted(trained))
    for file, data in trained.items():
        assert converted[file] == data, file
    for name, files in man.weight_map.items():
        if is_expert_param(name):
            p = int(re.search(r"-pp(\d+)", files[0]).group(1))
            assert files == [expert_file_name(e, t, p) for e in range(lay.ep)
                             for t in range(lay.etp)], name
        else:
            assert all(f.startswith("model-") for f in files), name


def test_ep_round_trips_are_bit_exact_and_match_training_files(mixtral, tmp_path):
    src, state = mixtral
    original = _global_bytes(src)
    hops = [  # (kwargs, the layout fields the manifest must record)
        ({"ep": 2, "dp": 2}, {"ep": 2, "etp": 1, "dp": 2, "tp": 1}),
        ({"ep": 1}, {"ep": 1, "etp": 1, "dp": 1}),
        ({"ep": 2, "etp": 2, "tp": 2, "dp": 2},
         {"ep": 2, "etp": 2, "tp": 2, "dp": 2, "sequence_parallel": True}),
        ({"ep": 1, "tp": 1}, {"ep": 1, "etp": 1, "tp": 1}),
        # A chain through ep 4: each hop reads the previous hop's pieces.
        ({"ep": 4, "dp": 4}, {"ep": 4, "etp": 1, "dp": 4}),
        ({"ep": 2, "etp": 2, "pp": 2, "dp": 4}, {"ep": 2, "etp": 2, "pp": 2}),
        ({"ep": 4, "etp": 2, "pp": 1, "dp": 8}, {"ep": 4, "etp": 2, "dp": 8}),
        ({"ep": 1, "etp": 1, "tp": 2}, {"ep": 1, "tp": 2}),
        ({"ep": 1, "tp": 1}, {"ep": 1, "tp": 1}),
    ]
    prev = src
    for i, (kwargs, want) in enumerate(hops):
        dst = tmp_path / f"hop{i}"
        summary = reshard_checkpoint(prev, dst, progress=False, **kwargs)
        lay = read_manifest(dst).layout
        assert {k: getattr(lay, k) for k in want} == want, (i, lay)
        assert summary.expert_grid == (lay.ep, lay.etp)
        assert _global_bytes(dst) == original, (i, kwargs)
        if lay.ep * lay.etp > 1 and i in (0, 2, 5):  # pp 2 with a grid; tp 2 with etp 2
            _check_pieces_like_training(dst, src, tmp_path / f"trained{i}")
        if i in (2, 6):  # load_checkpoint reads any expert grid into the one-process model
            got = load_checkpoint(dst).state_dict()
            assert all(torch.equal(got[k], v) for k, v in state.items())
        prev = dst
    # The last hop is the plain ep1 form: the same files as a direct conversion.
    direct = reshard_checkpoint(src, tmp_path / "direct", tp=1, progress=False).destination
    assert sorted(f.name for f in Path(direct).iterdir()) == sorted(
        f.name for f in prev.iterdir())


def test_qwen_moe_with_shared_expert_round_trips(tmp_path):
    """Qwen-MoE: 8 experts of FFN 32, a shared expert (split over tp like a dense MLP)."""
    src = save_checkpoint(tmp_path / "single", build_model(QWEN, seed=2))
    original = _global_bytes(src)
    a = reshard_checkpoint(src, tmp_path / "a", ep=4, etp=2, tp=2, dp=4,
                           progress=False).destination
    b = reshard_checkpoint(a, tmp_path / "b", ep=8, dp=8, dtype="bf16", progress=False
                           ).destination
    c = reshard_checkpoint(a, tmp_path / "c", ep=1, tp=1, progress=False).destination
    assert _global_bytes(a) == original and _global_bytes(c) == original
    cast = CheckpointReader(b)  # a cast is per element: bank pieces cast like whole tensors
    src_reader = CheckpointReader(src)
    for name in cast.names():
        assert torch.equal(cast.global_tensor(name),
                           src_reader.global_tensor(name).to(torch.bfloat16)), name
    _check_pieces_like_training(Path(a), src, tmp_path / "trained")
    # FP8 quantizes the dense linear layers; expert banks keep their dtype, bit for bit.
    fp8 = reshard_checkpoint(src, tmp_path / "fp8", ep=2, dp=2, fp8=True, progress=False)
    fp8_reader = CheckpointReader(fp8.destination)
    for name in fp8_reader.names():
        if is_expert_param(name):
            assert _bytes(fp8_reader.global_tensor(name)) == original[name], name
    assert fp8_reader.raw_shards("layers.0.attention.wqkv.weight")[0].dtype == torch.float8_e4m3fn


def test_deepseek_moe_with_routing_bias_round_trips(tmp_path):
    """DeepSeek-shaped: layer 0 dense, an ungated shared expert, group-limited sigmoid routing
    with a (non-zero) routing bias, which the checkpoint keeps and every reshard carries."""
    config = ModelConfig.from_name(
        "qwen-moe-tiny", num_layers=3, moe_first_dense_layers=1, moe_shared_expert_gated=False,
        moe_shared_ffn_hidden_size=64, moe_router_score="sigmoid", moe_expert_bias=True,
        moe_num_groups=2, moe_topk_groups=1, moe_group_score="top2_sum", moe_routed_scale=2.5)
    model = build_model(config, seed=3)
    bias = torch.linspace(-0.5, 0.5, 8)
    with torch.no_grad():
        for i in (1, 2):
            model.layers[str(i)].feed_forward.router.expert_bias.copy_(bias * i)
    src = save_checkpoint(tmp_path / "single", model)
    original = _global_bytes(src)
    assert "layers.2.feed_forward.router.expert_bias" in original
    assert "layers.1.feed_forward.shared_expert_gate.weight" not in original
    a = reshard_checkpoint(src, tmp_path / "a", ep=4, etp=2, tp=2, dp=4,
                           progress=False).destination
    c = reshard_checkpoint(a, tmp_path / "c", ep=1, tp=1, progress=False).destination
    assert _global_bytes(a) == original and _global_bytes(c) == original
    _check_pieces_like_training(Path(a), src, tmp_path / "trained")
    loaded = load_checkpoint(c)
    assert torch.equal(loaded.layers["2"].feed_forward.router.expert_bias, bias * 2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids), model.eval()(ids))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ep": 3, "dp": 3}, r"num_experts 4 is not divisible by ep 3; .* use ep in \[1, 2, 4\]"),
    ({"ep": 2, "etp": 3, "dp": 6}, r"expert FFN size 128 is not divisible by etp 3; use etp in"),
    ({"ep": 2}, r"ep 2 does not divide dp 1 x cp 1 = 1(.|\n)*the input's dp 1 \(set another "
                r"with --dp\)"),
    ({"ep": 2, "etp": 2, "dp": 2}, r"ep 2 x etp 2 = 4 does not divide the ranks of a pipeline "
                                   r"stage, tp 1 x cp 1 x dp 2 = 2(.|\n)*--dp\)"),
    ({"ep": 0}, r"ep must be >= 1, got 0"),
])
def test_bad_expert_layouts_fail_before_writing(mixtral, tmp_path, kwargs, message):
    src, _ = mixtral
    with pytest.raises(ConfigError, match=message):
        reshard_checkpoint(src, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left


def test_ep_of_a_dense_model_is_refused(tmp_path):
    dense = save_checkpoint(tmp_path / "dense", build_model(ModelConfig.from_name(
        "llama-tiny", num_layers=2), seed=0))
    with pytest.raises(ConfigError, match=r"this model is dense \(num_experts 0\)"):
        reshard_checkpoint(dense, tmp_path / "out", ep=2, dp=2, progress=False)


def _reset_peak() -> None:
    """Return freed heap pages to the system (else a conversion reuses resident pages and
    its growth is invisible), then reset the peak RSS to the current RSS."""
    ctypes.CDLL(None).malloc_trim(0)  # glibc
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS (Linux >= 4.0)
        fh.write("5")


def _peak_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_memory_stays_a_few_chunks_with_large_banks(tmp_path, monkeypatch):
    """Banks of 16 MiB (w1) and 8 MiB (w2), converted with 256 KiB chunks: the
    process's peak RSS grows by a few chunks, not by a bank, whether the source holds whole
    banks or ep pieces (the RSS above the start of each conversion, printed)."""
    config = ModelConfig.from_name("mixtral-tiny", num_layers=1, hidden_size=256,
                                   num_heads=4, num_kv_heads=2, ffn_hidden_size=1024,
                                   moe={"num_experts": 8})
    src = save_checkpoint(tmp_path / "single", build_model(config, seed=1))
    bank = 8 * 2 * 1024 * 256 * 4  # w1 of one layer, fp32
    monkeypatch.setattr(reshard_mod, "CHUNK_BYTES", 256 << 10)
    grown = {}
    for name, source, kwargs in (("ep1 -> ep2", src, {"ep": 2, "dp": 2}),
                                 ("ep2 -> ep4 x etp2", tmp_path / "ep1 -> ep2",
                                  {"ep": 4, "etp": 2, "dp": 8}),
                                 ("ep4 x etp2 -> ep1", tmp_path / "ep2 -> ep4 x etp2",
                                  {"ep": 1})):
        _reset_peak()
        start = _peak_kib()
        reshard_checkpoint(source, tmp_path / name, progress=False, **kwargs)
        grown[name] = (_peak_kib() - start) * 1024
    # The old path for ep sources put each bank together whole: that is what the bound excludes.
    _reset_peak()
    start = _peak_kib()
    whole = CheckpointReader(tmp_path / "ep1 -> ep2").global_tensor(
        "layers.0.feed_forward.experts.w1")
    grown["whole w1 bank, for scale"] = (_peak_kib() - start) * 1024
    del whole
    print("peak RSS growth (MiB): " + ", ".join(f"{k}: {v / 2**20:.1f}"
                                                 for k, v in grown.items()))
    assert grown["whole w1 bank, for scale"] >= bank // 2
    for name in ("ep1 -> ep2", "ep2 -> ep4 x etp2", "ep4 x etp2 -> ep1"):
        assert grown[name] < bank // 4, (name, grown)
    assert _global_bytes(tmp_path / "ep4 x etp2 -> ep1") == _global_bytes(src)


def test_cli_writes_an_expert_grid_and_explains_a_bad_one(mixtral, tmp_path, capsys):
    from tessera.converters.cli import main

    src, _ = mixtral
    out = tmp_path / "ep4"
    assert main(["--input", str(src), "--output", str(out), "--ep", "4", "--dp", "4"]) == 0
    assert "experts ep 4 x etp 1 (for dp 4)" in capsys.readouterr().out
    assert len(list(out.glob("experts-*"))) == 4 and _global_bytes(out) == _global_bytes(src)
    assert main(["--input", str(src), "--output", str(tmp_path / "bad"), "--ep", "4"]) == 1
    err = capsys.readouterr().err
    assert "ep 4 does not divide dp 1 x cp 1 = 1" in err and "set another with --dp" in err
