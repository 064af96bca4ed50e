"""Files Tessera writes get the mode an ordinary new file gets (0644 under umask 022), not the
0600 of mkstemp / safetensors, so another user (a non-root container) can read them."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tessera.core.files import atomic_file, file_mode, save_safetensors, umask
from tessera.core.tokenizer import load_tokenizer, train_tokenizer


@pytest.fixture(params=[0o022, 0o077])
def mask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask and file_mode() == 0o666 & ~mask
    assert os.umask(mask) == mask  # unchanged by reading it


def test_safetensors_and_tokenizers_follow_the_umask(tmp_path, mask):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    want = _mode(plain)  # what open() gives: the reference
    assert want == (0o644 if mask == 0o022 else 0o600)

    save_safetensors({"a": torch.zeros(2)}, tmp_path / "a.safetensors")
    assert _mode(tmp_path / "a.safetensors") == want

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus with words" for i in range(200)))
    train_tokenizer([corpus], 300, tmp_path / "tok.model", "bpe", num_threads=1)
    assert _mode(tmp_path / "tok.model") == want
    load_tokenizer(tmp_path / "tok.model").save(tmp_path / "copy.model")
    assert _mode(tmp_path / "copy.model") == want


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path, mask):
    target = tmp_path / "sub" / "table.bin"
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"old")
    assert target.read_bytes() == b"old" and stat.S_IMODE(target.stat().st_mode) == file_mode()
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"  # untouched, and no temporary file left behind
    assert [p.name for p in target.parent.iterdir()] == ["table.bin"]
