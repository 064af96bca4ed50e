"""`tessera preprocess`: text/JSONL/.gz -> indexed dataset, deterministic for any worker count."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.core.tokenizer import SentencePieceTokenizer, train_tokenizer
from tessera.training import preprocess
from tessera.training.indexed_dataset import IndexedDataset


def _write_inputs(directory: Path, docs: list[str]) -> tuple[list[Path], list[str]]:
    """Four files, one per format, holding `docs` in order; returns (files, expected docs)."""
    quarter = len(docs) // 4
    parts = [docs[i * quarter : (i + 1) * quarter] for i in range(4)]
    txt, jsonl = directory / "a.txt", directory / "b.jsonl"
    txt_gz, jsonl_gz = directory / "c.txt.gz", directory / "d.jsonl.gz"
    # paragraphs separated by blank lines, once with extra blank lines and CRLF endings
    txt.write_text("\n\n".join(parts[0]) + "\n")
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n\n" for i, d in enumerate(parts[1])))
    with gzip.open(txt_gz, "wt", newline="") as f:
        f.write("\r\n\r\n\r\n".join(d.replace("\n", "\r\n") for d in parts[2]))
    with gzip.open(jsonl_gz, "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in parts[3])
    return [txt, jsonl, txt_gz, jsonl_gz], [d for part in parts for d in part]


def test_round_trip_all_formats_and_worker_counts_give_identical_files(
    tmp_path: Path,
    documents: list[str],
    tokenizer_path: Path,
    tokenizer: SentencePieceTokenizer,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(preprocess, "CHUNK_DOCS", 7)  # many chunks, so the window really slides
    inputs, expected = _write_inputs(tmp_path, documents)
    for workers in (1, 2):
        stats = preprocess.preprocess(
            inputs, tokenizer_path, tmp_path / f"w{workers}", workers=workers, progress=False
        )
        assert (stats.documents, stats.skipped, stats.empty) == (len(expected), 0, 0)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "w2")
    ds.check_vocab(tokenizer)
    assert len(ds) == len(expected) and ds.num_tokens == stats.tokens
    for i, doc in enumerate(expected):
        assert ds[i].tolist() == tokenizer.encode(doc, eos=True), f"document {i}"


def test_no_append_eod_and_blank_documents(
    tmp_path: Path, tokenizer_path: Path, tokenizer: SentencePieceTokenizer
):
    src = tmp_path / "x.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["one two", "", "   ", "three"]))
    stats = preprocess.preprocess([src], tokenizer_path, tmp_path / "o", append_eod=False)
    assert (stats.documents, stats.empty) == (2, 2)
    ds = IndexedDataset(tmp_path / "o")
    assert [ds[0].tolist(), ds[1].tolist()] == [
        tokenizer.encode("one two"),
        tokenizer.encode("three"),
    ]


def _bad_jsonl(path: Path) -> None:
    lines = [
        json.dumps({"text": "first good document"}),
        json.dumps({"text": "second good one"}),
        '{"text": "unterminated',  # line 3: invalid JSON
        json.dumps({"text": "third good one"}),
        json.dumps(["not", "an", "object"]),  # line 5
        json.dumps({"txt": "wrong key"}),  # line 6
        json.dumps({"text": 42}),  # line 7: not a string
        json.dumps({"text": "last good document"}),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_data_made_with_another_tokenizer_is_detected(
    tmp_path: Path, documents: list[str], tokenizer_path: Path
):
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(documents[:20]))
    preprocess.preprocess([src], tokenizer_path, tmp_path / "o", progress=False)
    other = train_tokenizer([], 350, tmp_path / "other.model", texts=documents, num_threads=1)
    with pytest.raises(ValueError, match="vocabulary of 400 ids but the tokenizer has 350"):
        IndexedDataset(tmp_path / "o").check_vocab(other)


def test_malformed_lines_are_skipped_and_counted(
    tmp_path: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
):
    src = tmp_path / "bad.jsonl"
    _bad_jsonl(src)
    argv = ["--input", str(src), "--tokenizer", str(tokenizer_path), "--output-prefix"]
    assert preprocess.main([*argv, str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    for lineno in (3, 5, 6, 7):
        assert f"{src}:{lineno}:" in err
    assert "4 documents" in out and "skipped 4 malformed lines" in out
    assert len(IndexedDataset(tmp_path / "o")) == 4


def test_strict_stops_at_the_first_malformed_line_and_writes_nothing(
    tmp_path: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
):
    src = tmp_path / "bad.jsonl"
    _bad_jsonl(src)
    argv = ["--input", str(src), "--tokenizer", str(tokenizer_path), "--output-prefix"]
    assert preprocess.main([*argv, str(tmp_path / "o"), "--strict"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:3: invalid JSON" in err and ":5:" not in err
    assert list(tmp_path.glob("o*")) == []
    with pytest.raises(preprocess.MalformedInputError, match=r"bad\.jsonl:3:"):
        preprocess.preprocess([src], tokenizer_path, tmp_path / "o", strict=True, workers=2)
    assert list(tmp_path.glob("o*")) == []


def test_missing_input_or_tokenizer_is_a_clear_error(
    tmp_path: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
):
    base = ["--output-prefix", str(tmp_path / "o")]
    assert preprocess.main([*base, "--input", "nope.txt", "--tokenizer", str(tokenizer_path)]) == 1
    assert "input file not found: nope.txt" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("hello")
    assert preprocess.main([*base, "--input", str(tmp_path / "a.txt"), "--tokenizer", "no.model"]) == 1
    assert "tokenizer not found: no.model" in capsys.readouterr().err


def test_chunks_respect_the_byte_and_document_bounds(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(preprocess, "CHUNK_CHARS", 10)
    monkeypatch.setattr(preprocess, "CHUNK_DOCS", 3)
    docs = ["abcd", "ef", "g", "h", "i", "a" * 50, "j"]
    chunks = list(preprocess._chunks(docs))
    assert chunks == [["abcd", "ef", "g"], ["h", "i", "a" * 50], ["j"]]
    assert [d for c in chunks for d in c] == docs


def test_help_runs_through_python_m_tessera():
    result = subprocess.run(
        [sys.executable, "-m", "tessera", "preprocess", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--input",
        "--tokenizer",
        "--output-prefix",
        "--workers",
        "--json-key",
        "--strict",
    ):
        assert flag in result.stdout
    assert "--no-append-eod" in result.stdout


def test_documents_in_a_txt_file_are_paragraphs(tmp_path: Path):
    src = tmp_path / "p.txt"
    src.write_text("\n\nfirst line\nsecond line\n  \n\nnext doc\n\n\nlast\n")
    assert list(preprocess.iter_documents(src)) == ["first line\nsecond line", "next doc", "last"]
    assert not any(preprocess.is_jsonl(p) for p in ("a.txt", "a.txt.gz", "wiki_00"))
    assert all(preprocess.is_jsonl(p) for p in ("a.jsonl", "a.json.gz", "a.ndjson"))
