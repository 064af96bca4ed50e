"""Resharding: bit-exact round trips between layouts, per-rank files, and clear failures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tessera.converters import reshard as reshard_mod
from tessera.converters.reshard import reshard_checkpoint, target_files
from tessera.converters.safetensors_stream import (
    SafetensorsFile,
    SafetensorsFormatError,
    SafetensorsWriter,
)
from tessera.core.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_checkpoint,
    load_weights,
    read_manifest,
    shard_file_name,
    stored_parameters,
)
from tessera.core.config import ConfigError, Layout
from tessera.core.init import build_model
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import (
    global_param_shapes,
    shard_scale,
    shard_tensor,
    stage_ids,
)

from .ckpt_factory import CONFIGS, assert_rank_files, global_tensors, make_checkpoint

# (tp, pp, virtual stages), visited in order; every hop must preserve every tensor exactly.
CHAIN = [(2, 2, 1), (1, 1, 1), (4, 1, 1), (1, 1, 1), (2, 2, 2), (4, 2, 1), (2, 1, 1), (1, 1, 1)]


@pytest.mark.parametrize("family", CONFIGS)
def test_round_trips_between_layouts_are_bit_exact(family, tmp_path):
    config = CONFIGS[family]
    src = make_checkpoint(tmp_path / "orig", config, seed=3)
    original = global_tensors(src)
    for i, (tp, pp, vs) in enumerate(CHAIN):
        dst = tmp_path / f"hop{i}-tp{tp}-pp{pp}-vs{vs}"
        summary = reshard_checkpoint(src, dst, tp=tp, pp=pp, virtual_stages=vs, progress=False)
        assert summary.layout == {"tp": tp, "pp": pp, "virtual_stages": vs}
        assert summary.files == tp * pp and summary.bytes_written > 0
        got = global_tensors(dst)
        assert got.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(got[name], tensor), (dst.name, name)
        assert_rank_files(dst, original, config, tp, pp, vs)
        assert list(read_manifest(dst).weight_map) == list(global_param_shapes(config))
        src = dst
    # Back at tp1 x pp1 the single file is byte-for-byte the tensors of the original save.
    with safe_open(str(src / shard_file_name(0, 0)), "pt") as a, \
            safe_open(str(tmp_path / "orig" / shard_file_name(0, 0)), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


@pytest.mark.parametrize("family", CONFIGS)
def test_resharded_checkpoints_give_identical_logits(family, tmp_path):
    config = CONFIGS[family]
    src = make_checkpoint(tmp_path / "orig", config, seed=5)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        want = load_checkpoint(src)(ids)
        for tp, pp, vs in [(2, 2, 2), (4, 1, 1)]:
            dst = reshard_checkpoint(src, tmp_path / f"tp{tp}pp{pp}", tp=tp, pp=pp,
                                     virtual_stages=vs, progress=False).destination
            assert torch.equal(load_checkpoint(dst)(ids), want)


@pytest.mark.parametrize("family", CONFIGS)
def test_each_target_rank_reads_only_its_own_file(family, tmp_path, monkeypatch):
    config = CONFIGS[family]
    src = make_checkpoint(tmp_path / "orig", config, seed=1)
    original = global_tensors(src)
    tp, pp, vs = 2, 2, 2
    dst = tmp_path / "tp2pp2vs2"
    reshard_checkpoint(src, dst, tp=tp, pp=pp, virtual_stages=vs, progress=False)
    opened: list[str] = []
    real_open = CheckpointReader._open
    monkeypatch.setattr(CheckpointReader, "_open",
                        lambda self, f: (opened.append(f), real_open(self, f))[1])
    layout = Layout(tp=tp, pp=pp, virtual_stages=vs)
    for p in range(pp):
        for t in range(tp):
            groups = ParallelGroups(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
            chunks = [build_model(config, layout, groups, stage_id=s, num_stages=pp * vs,
                                  init=False) for s in stage_ids(layout, p)]
            opened.clear()
            load_weights(chunks, dst)
            own = {shard_file_name(t, p)}
            if config.tied_embeddings and p == pp - 1:  # its output copy is the stored embedding
                own.add(shard_file_name(t, 0))
            assert set(opened) == own, (t, p, opened)
            for chunk in chunks:
                for local_name, param in chunk.named_parameters():
                    name = chunk.global_name(local_name)
                    assert torch.equal(param, shard_tensor(name, original[name], config, t, tp))


def test_v_shape_placement_puts_first_and_last_stage_on_rank_0(tmp_path):
    config = CONFIGS["tied"]
    src = make_checkpoint(tmp_path / "orig", config, seed=2)
    original = global_tensors(src)
    dst = tmp_path / "zbv"
    summary = reshard_checkpoint(src, dst, tp=2, pp=2, placement="v", progress=False)
    assert summary.layout == {"tp": 2, "pp": 2, "virtual_stages": 2}
    assert_rank_files(dst, original, config, 2, 2, 2, placement="v")
    with safe_open(str(dst / shard_file_name(1, 0)), "pt") as fh:  # stages 0 and 3
        assert {"layers.0.attention.wqkv.weight", "layers.3.attention.wqkv.weight",
                "tok_embeddings.weight", "norm.weight"} <= set(fh.keys())
    back = reshard_checkpoint(dst, tmp_path / "tp1", tp=1, pp=1, progress=False)
    assert all(torch.equal(t, original[n]) for n, t in global_tensors(back.destination).items())


def test_target_files_hold_what_each_rank_holds():
    config = CONFIGS["tied"]
    files = target_files(config, Layout(tp=2, pp=2))
    assert set(files) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert "tok_embeddings.weight" in files[1, 0] and "tok_embeddings.weight" not in files[1, 1]
    assert files[1, 0]["tok_embeddings.weight"] == (502, 64)  # 1003 padded to 1004, halved
    # Replicated tensors go to every tp rank (save_checkpoint stores them on tp rank 0 only).
    assert files[0, 1]["norm.weight"] == files[1, 1]["norm.weight"] == (64,)
    # The tied output copy on a separate last stage is never stored (core fix: it used to be
    # listed next to the embedding, doubling the shard list of tok_embeddings.weight).
    with torch.device("meta"):
        last = GPTModel(config, Layout(pp=2), ParallelGroups(pp_rank=1, pp_size=2), 1, 2)
    assert last.output is not None and "tok_embeddings.weight" not in stored_parameters([last])


def test_dtype_cast_step_tokenizer_and_extra_are_carried(tmp_path):
    config = CONFIGS["gqa"]
    tok = tmp_path / "tok.model"
    tok.write_bytes(b"not really sentencepiece \x00\x01")
    src = make_checkpoint(tmp_path / "orig", config, step=42, tokenizer=tok, extra={"run": "x"})
    original = global_tensors(src)
    dst = tmp_path / "bf16"
    summary = reshard_checkpoint(src, dst, tp=2, dtype="bf16", progress=False)
    man = read_manifest(dst)
    assert (man.dtype, man.step, man.tokenizer, man.extra) == ("bfloat16", 42, "tokenizer.model",
                                                               {"run": "x"})
    assert (dst / "tokenizer.model").read_bytes() == tok.read_bytes()
    got = global_tensors(dst)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in original.items())
    assert summary.bytes_written < summary.bytes_read * 0.6  # half the bytes, plus headers
    assert "tp 2 x pp 1" in str(summary) and "peak memory" in str(summary)
    back = reshard_checkpoint(dst, tmp_path / "fp32", tp=1, dtype=torch.float32, progress=False)
    assert all(torch.equal(t, got[n].float()) for n, t in global_tensors(back.destination).items())


def _no_leftovers(parent: Path, name: str) -> bool:
    return not any(p.name.startswith((name, f".{name}")) for p in parent.iterdir())


def test_truncated_input_is_a_clear_error_and_writes_nothing(tmp_path):
    src = reshard_checkpoint(make_checkpoint(tmp_path / "orig", CONFIGS["gqa"]), tmp_path / "tp2",
                             tp=2, progress=False).destination
    victim = Path(src) / shard_file_name(1, 0)
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        reshard_checkpoint(src, tmp_path / "out", tp=1, progress=False)
    assert _no_leftovers(tmp_path, "out")
    with pytest.raises(CheckpointError, match="truncat|readable"):  # the core reader says so too
        load_checkpoint(src)


def test_foreign_format_version_is_a_clear_error(tmp_path):
    src = make_checkpoint(tmp_path / "orig", CONFIGS["gqa"])
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["format_version"] = 99
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99"):
        reshard_checkpoint(src, tmp_path / "out", tp=2, progress=False)
    assert _no_leftovers(tmp_path, "out")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tp": 3}, "num_heads 8 is not divisible by tp 3"),
    # tp 8 replicates the 4 kv heads; tp 6 neither divides nor is a multiple of them.
    ({"tp": 6}, "num_kv_heads 4 and tp 6: tp must divide num_kv_heads"),
    ({"pp": 3}, "num_layers 4 is not divisible by pp 3"),
    ({"pp": 2, "virtual_stages": 4}, "num_layers 4 is not divisible by pp 2 x virtual_stages 4"),
    ({"tp": 0}, "tp must be >= 1"),
])
def test_impossible_layouts_fail_before_writing(tmp_path, kwargs, message):
    src = make_checkpoint(tmp_path / "orig", CONFIGS["gqa"])
    with pytest.raises(ConfigError, match=message):
        reshard_checkpoint(src, tmp_path / "out", progress=False, **kwargs)
    assert _no_leftovers(tmp_path, "out")


def test_existing_output_needs_overwrite(tmp_path):
    src = make_checkpoint(tmp_path / "orig", CONFIGS["gqa"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        reshard_checkpoint(src, out, tp=2, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    reshard_checkpoint(src, out, tp=2, overwrite=True, progress=False)
    assert read_manifest(out).layout.tp == 2 and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failure_mid_way_leaves_no_output(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path / "orig", CONFIGS["gqa"])
    calls = {"n": 0}
    real_write = SafetensorsWriter.write

    def flaky(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError("disk full (simulated)")
        return real_write(self, name, tensor)

    monkeypatch.setattr(reshard_mod.SafetensorsWriter, "write", flaky)
    with pytest.raises(OSError, match="simulated"):
        reshard_checkpoint(src, tmp_path / "out", tp=2, pp=2, progress=False)
    assert _no_leftovers(tmp_path, "out")


def test_stream_writer_files_load_with_safetensors(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(2, 2).half(), "fp8": torch.randn(5, 3).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "i64": torch.arange(5),
    }
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, [(k, v.dtype, v.shape) for k, v in tensors.items()],
                           metadata={"format": "pt"}) as w:
        for name in reversed(list(tensors)):  # any order: each goes to its own offset
            w.write(name, tensors[name])
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        for name, want in tensors.items():
            got = fh.get_tensor(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
    reader = SafetensorsFile(path)
    assert all(torch.equal(reader.get_tensor(k), v) for k, v in tensors.items())
    reader.close()


def test_stream_writer_and_reader_refuse_bad_input(tmp_path):
    path = tmp_path / "x.safetensors"
    w = SafetensorsWriter(path, [("a", torch.float32, (2, 2)), ("b", torch.float32, (3,))])
    with pytest.raises(ValueError, match="declared"):
        w.write("a", torch.zeros(2, 3))
    with pytest.raises(KeyError):
        w.write("c", torch.zeros(1))
    w.write("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="never written"):
        w.close()
    path.write_bytes(b"\x10\x00")
    with pytest.raises(SafetensorsFormatError, match="too short"):
        SafetensorsFile(path)
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsFormatError, match="truncated"):
        SafetensorsFile(path)


def test_cli_places_stages_in_a_v(tmp_path):
    from tessera.converters.cli import main

    src = make_checkpoint(tmp_path / "orig", CONFIGS["tied"], seed=2)
    dst = tmp_path / "zbv"
    assert main(["--input", str(src), "--output", str(dst), "--pp", "2",
                 "--placement", "v"]) == 0
    layout = read_manifest(dst).layout
    assert (layout.pp, layout.virtual_stages, layout.placement) == (2, 2, "v")


def test_cli_reshards_casts_and_quantizes(tmp_path, capsys):
    """`tessera convert` routes layout flags, --fp8 and a bare --dtype to the resharder."""
    import torch

    from tessera.converters.cli import main
    from tessera.core import ModelConfig, build_model, load_checkpoint, save_checkpoint
    from tessera.core.checkpoint import read_manifest

    config = ModelConfig.from_name("llama-tiny", vocab_size=1003, num_layers=4)
    src = save_checkpoint(tmp_path / "src", build_model(config, seed=5))
    ids = torch.randint(0, 1003, (2, 12))
    reference = load_checkpoint(src)(ids)
    assert main(["--input", str(src), "--output", str(tmp_path / "tp2"), "--tp", "2",
                 "--pp", "2"]) == 0
    assert "tp 2 x pp 2" in capsys.readouterr().out
    assert torch.equal(load_checkpoint(tmp_path / "tp2")(ids), reference)
    assert main(["--input", str(src), "--output", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert read_manifest(tmp_path / "bf16").dtype == "bfloat16"
    assert main(["--input", str(src), "--output", str(tmp_path / "fp8"), "--fp8"]) == 0
    assert read_manifest(tmp_path / "fp8").fp8["granularity"] == "tensor"
    assert main(["--input", str(src), "--output", str(tmp_path / "tp2"), "--tp", "1"]) == 1
    assert "--overwrite" in capsys.readouterr().err


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Every tensor streamed in chunks of 600 bytes (or of one row, if wider); records the
    largest read and write of more than one row, and the number of row writes."""
    seen = {"read": 0, "write": 0, "rows_written": 0}

    def size(t):
        return t.nbytes if t.dim() and t.shape[0] > 1 else 1
    monkeypatch.setattr(reshard_mod, "CHUNK_BYTES", 600)
    real_read, real_rows = reshard_mod.StreamingReader.read_rows, SafetensorsWriter.write_rows
    real_write = SafetensorsWriter.write

    def read_rows(self, file, key, row, out):
        seen["read"] = max(seen["read"], size(out))
        return real_read(self, file, key, row, out)

    def write_rows(self, name, row, tensor):
        seen["write"], seen["rows_written"] = max(seen["write"], size(tensor)), seen["rows_written"] + 1
        return real_rows(self, name, row, tensor)

    def write(self, name, tensor):
        if not name.endswith(".scale"):
            seen["write"] = max(seen["write"], size(tensor))
        return real_write(self, name, tensor)

    monkeypatch.setattr(reshard_mod.StreamingReader, "read_rows", read_rows)
    monkeypatch.setattr(SafetensorsWriter, "write_rows", write_rows)
    monkeypatch.setattr(SafetensorsWriter, "write", write)
    return seen


@pytest.mark.parametrize("family", CONFIGS)
def test_row_chunked_streaming_is_bit_exact(family, tmp_path, tiny_chunks):
    """With chunks of a row or two, every tensor (vocabulary 1003 padded at tp 2 and 4, GQA
    fused QKV, SwiGLU gate/up, row-parallel columns, tied or not) crosses every layout intact."""
    config = CONFIGS[family]
    src = make_checkpoint(tmp_path / "orig", config, seed=4)
    original = global_tensors(src)
    for i, (tp, pp, vs) in enumerate(CHAIN[:6]):
        dst = tmp_path / f"hop{i}"
        reshard_checkpoint(src, dst, tp=tp, pp=pp, virtual_stages=vs, progress=False)
        got = global_tensors(dst)
        assert all(torch.equal(got[n], t) for n, t in original.items()), dst.name
        assert_rank_files(dst, original, config, tp, pp, vs)
        src = dst
    assert 0 < tiny_chunks["read"] <= 600 and 0 < tiny_chunks["write"] <= 600
    assert tiny_chunks["rows_written"] > 1000
    bf16 = reshard_checkpoint(src, tmp_path / "bf16", tp=4, dtype="bf16", progress=False)
    got = global_tensors(bf16.destination)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in original.items())


@pytest.mark.parametrize("per_channel", [False, True])
def test_row_chunked_fp8_matches_whole_tensor_quantization(per_channel, tmp_path, monkeypatch):
    """Per-tensor scales from the chunked amax pass and per-channel ones from each chunk's rows
    equal `quantize` of the whole global tensor; an FP8 source reshards bit-exactly in chunks."""
    from tessera.core.fp8 import quantize

    config = CONFIGS["gqa"]
    src = make_checkpoint(tmp_path / "orig", config, seed=6, dtype=torch.bfloat16)
    original = global_tensors(src)
    monkeypatch.setattr(reshard_mod, "CHUNK_BYTES", 300)
    fp8 = reshard_checkpoint(src, tmp_path / "fp8", tp=2, pp=2, fp8=True,
                             fp8_per_channel=per_channel, progress=False).destination
    reader = CheckpointReader(fp8)
    for name, files in reader.manifest.weight_map.items():
        if reader._get(files[0], name).dtype != torch.float8_e4m3fn:
            assert torch.equal(reader.global_tensor(name), original[name]), name
            continue
        q, scale = quantize(original[name], per_channel)
        for t, file in enumerate(files):
            assert torch.equal(reader._get(file, name), shard_tensor(name, q, config, t, 2)), name
            want = shard_scale(name, scale, config, t, 2)
            assert torch.equal(reader._get(file, name + ".scale"), want), name
    src_raw = {n: CheckpointReader(fp8).raw_shards(n) for n in reader.names()}
    back = reshard_checkpoint(fp8, tmp_path / "tp4", tp=4, progress=False).destination
    again = reshard_checkpoint(back, tmp_path / "tp2pp2", tp=2, pp=2, progress=False).destination
    for name, shards in src_raw.items():
        assert all(torch.equal(a, b) for a, b in
                   zip(CheckpointReader(again).raw_shards(name), shards, strict=True)), name


def test_stream_rows_write_and_read_back(tmp_path):
    path = tmp_path / "rows.safetensors"
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    with SafetensorsWriter(path, [("a", torch.float32, (10, 4)), ("b", torch.float32, (3,))]) as w:
        w.write_rows("a", 6, full[6:])  # any order, any split
        w.write_rows("a", 0, full[:6])
        with pytest.raises(ValueError, match="twice"):
            w.write_rows("a", 0, full[:1])
        with pytest.raises(ValueError, match="do not fit"):
            w.write_rows("b", 2, torch.zeros(2))
        w.write_rows("b", 0, torch.ones(3))
    reader = SafetensorsFile(path)
    assert torch.equal(reader.get_tensor("a"), full)
    out = reader.read_rows_into("a", 3, torch.empty(5, 4))
    assert torch.equal(out, full[3:8])
    with pytest.raises(ValueError, match="cannot read rows"):
        reader.read_rows_into("a", 8, torch.empty(5, 4))
    reader.close()
    w = SafetensorsWriter(path, [("a", torch.float32, (10, 4))])
    w.write_rows("a", 0, full[:9])
    with pytest.raises(ValueError, match="never written"):
        w.close()
