"""`tessera inspect` checks the weight files against the manifest: a damaged checkpoint exits 1
with one line per damage naming the file and what is wrong; an intact one exits 0."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from safetensors.torch import load_file, save_file

from tessera.converters.inspect import main
from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint_verify import verify_checkpoint

from .ckpt_factory import CONFIGS, make_checkpoint

FILE = "model-tp01-pp00.safetensors"


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """A tp2 x pp2 FP8 checkpoint (sharded, padded vocabulary, per-channel scales)."""
    root = tmp_path_factory.mktemp("damaged")
    plain = make_checkpoint(root / "plain", CONFIGS["gqa"], step=3)
    fp8 = root / "fp8"
    reshard_checkpoint(plain, fp8, tp=2, pp=2, fp8=True, fp8_per_channel=True, progress=False)
    return fp8


@pytest.fixture
def ckpt(intact, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(intact, copy)
    return copy


def _inspect(path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(path)])
    return rc, capsys.readouterr().err


def test_an_intact_checkpoint_passes(intact, capsys):
    assert verify_checkpoint(intact) == []
    rc, err = _inspect(intact, capsys)
    assert rc == 0 and err == ""


def test_a_truncated_file_is_named(ckpt, capsys):
    f = ckpt / FILE
    f.write_bytes(f.read_bytes()[:-100])
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"damaged: {FILE}: tensor " in err and ": truncated" in err, err
    assert err.count("damaged:") == 1, err  # only the cut tensor: the last one in the file


def test_a_corrupted_header_is_named(ckpt, capsys):
    f = ckpt / FILE
    data = bytearray(f.read_bytes())
    data[9:13] = b"\xff\xfe{]"
    f.write_bytes(bytes(data))
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"{FILE}: the header is not valid JSON" in err, err
    # a header whose length field exceeds the file
    data[:8] = struct.pack("<Q", len(data) * 2)
    f.write_bytes(bytes(data))
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"{FILE}: the header claims" in err and "truncated" in err, err


def test_a_header_whose_byte_range_does_not_fit_the_shape_is_named(ckpt, capsys):
    f = ckpt / FILE
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32"
                and len(header[k]["shape"]) == 2)
    header[name]["shape"][0] -= 1
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    raw = raw.ljust(n)  # same length: the data stays in place
    f.write_bytes(data[:8] + raw + data[8 + n:])
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"{FILE}: tensor {name!r} spans bytes" in err, err


def test_a_missing_file_is_named(ckpt, capsys):
    (ckpt / FILE).unlink()
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"damaged: {FILE}: missing" in err, err


def test_an_extra_or_absent_tensor_is_named(ckpt, capsys):
    f = ckpt / FILE
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors["stowaway.weight"] = tensors[name].clone()
    del tensors[name]
    save_file(tensors, str(f))
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1, err
    assert f"{FILE}: holds tensor 'stowaway.weight', which the manifest does not list" in err
    assert f"{FILE}: tensor {name!r} is missing" in err


def test_a_shard_of_the_wrong_shape_is_named(ckpt, capsys):
    f = ckpt / FILE
    tensors = load_file(str(f))
    name = next(n for n, t in tensors.items() if t.dim() == 2 and t.dtype.is_floating_point
                and not n.endswith(".scale"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(f))
    rc, err = _inspect(ckpt, capsys)
    assert rc == 1 and f"tensor {name!r} is stored as" in err and "global shape" in err, err
