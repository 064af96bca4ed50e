"""The indexed binary dataset: format, atomic writes, and errors for damaged files."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from tessera.training.indexed_dataset import (
    HEADER_SIZE,
    IndexedDataset,
    IndexedDatasetWriter,
)


def _docs(seed: int = 0, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, rng.integers(1, 50)) for _ in range(40)]
    docs[7] = np.zeros(0, dtype=np.int64)  # an empty document is legal
    return docs


def _write(prefix: Path, docs: list[np.ndarray], vocab: int = 1000) -> None:
    with IndexedDatasetWriter(prefix, vocab) as writer:
        for doc in docs:
            writer.add_document(doc.tolist())


@pytest.mark.parametrize(("vocab", "dtype", "itemsize"), [(1000, np.uint16, 2), (70_000, np.int32, 4)])
def test_round_trip_and_dtype_follows_vocab(tmp_path: Path, vocab: int, dtype: type, itemsize: int):
    docs = _docs(vocab=vocab)
    _write(tmp_path / "d", docs, vocab)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == len(docs) and ds.vocab_size == vocab and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert (tmp_path / "d.bin").stat().st_size == ds.num_tokens * itemsize
    for got, want in zip((ds[i] for i in range(len(ds))), docs):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    np.testing.assert_array_equal(ds.get(3, 2, 4), docs[3][2:6])
    np.testing.assert_array_equal(ds.get(3, 2), docs[3][2:])
    # the header, parsed independently of the reader
    header = (tmp_path / "d.idx").read_bytes()[:HEADER_SIZE]
    magic, version, code, v, n_docs, n_tokens = struct.unpack("<8sIB3xQQQ", header)
    assert (magic, version, v, n_docs, n_tokens) == (b"TSRIDX\0\0", 1, vocab, 40, ds.num_tokens)


def test_reader_accepts_either_file_path_and_pickles_by_prefix(tmp_path: Path):
    _write(tmp_path / "d", _docs())
    ds = IndexedDataset(tmp_path / "d.idx")
    assert IndexedDataset(str(tmp_path / "d.bin")).num_tokens == ds.num_tokens
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # the prefix, not the tokens
    np.testing.assert_array_equal(pickle.loads(blob)[5], ds[5])


def test_out_of_range_reads_raise(tmp_path: Path):
    _write(tmp_path / "d", _docs())
    ds = IndexedDataset(tmp_path / "d")
    with pytest.raises(IndexError):
        ds[40]
    with pytest.raises(IndexError):
        ds.get(3, 0, len(ds[3]) + 1)


def test_nothing_is_published_before_finalize_or_after_an_error(tmp_path: Path):
    writer = IndexedDatasetWriter(tmp_path / "d", 1000)
    writer.add_document([1, 2, 3])
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    writer.finalize()
    assert IndexedDataset(tmp_path / "d").num_tokens == 3
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "d", 1000) as w2:
        w2.add_document([9, 9])
        raise RuntimeError("crash mid-write")
    assert IndexedDataset(tmp_path / "d").num_tokens == 3  # the old files are untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]  # no temp left


def test_ids_outside_vocab_are_refused(tmp_path: Path):
    with IndexedDatasetWriter(tmp_path / "d", 100) as writer:
        with pytest.raises(ValueError, match=r"\[0, 100\)"):
            writer.add_document([5, 100])
        with pytest.raises(ValueError):
            writer.add_document([-1])


def test_missing_files_name_the_file(tmp_path: Path):
    _write(tmp_path / "d", _docs())
    (tmp_path / "d.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"d\.bin.*tessera preprocess"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match=r"other\.idx"):
        IndexedDataset(tmp_path / "other")


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        ("d.bin", lambda b: b[:-2], r"d\.bin has \d+ bytes but .*truncated"),
        ("d.bin", lambda b: b + b"\0\0", r"d\.bin has \d+ bytes"),
        ("d.idx", lambda b: b[:20], r"d\.idx is truncated"),
        ("d.idx", lambda b: b[:-4], r"d\.idx has \d+ bytes but its header describes 40 documents"),
        ("d.idx", lambda b: b"XXXXXXXX" + b[8:], r"d\.idx is not a Tessera index file"),
        ("d.idx", lambda b: b[:8] + struct.pack("<I", 99) + b[12:], r"format version 99"),
        ("d.idx", lambda b: b[:12] + b"\x07" + b[13:], r"unknown token dtype code 7"),
    ],
)
def test_corrupt_files_are_reported_with_the_fix(tmp_path: Path, file, change, message):
    _write(tmp_path / "d", _docs())
    path = tmp_path / file
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(tmp_path / "d")
    assert "re-run `tessera preprocess`" in str(info.value)


def test_files_from_different_runs_are_detected(tmp_path: Path):
    _write(tmp_path / "a", _docs(seed=0))
    _write(tmp_path / "b", _docs(seed=1))
    (tmp_path / "b.bin").replace(tmp_path / "a.bin")  # a.idx now describes someone else's tokens
    with pytest.raises(ValueError, match="different runs"):
        IndexedDataset(tmp_path / "a")


def test_check_vocab(tmp_path: Path):
    _write(tmp_path / "d", _docs())
    ds = IndexedDataset(tmp_path / "d")
    ds.check_vocab(1000)
    with pytest.raises(ValueError, match=r"vocabulary of 1000 ids but the tokenizer has 32000"):
        ds.check_vocab(32000)


def test_empty_dataset_is_legal(tmp_path: Path):
    IndexedDatasetWriter(tmp_path / "e", 10).finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0
