"""`tessera tokenizer train` and `tessera preprocess`: an existing output is refused unless
--overwrite; a refused or failed run leaves no directory behind; lines that are not UTF-8 are
skipped and reported; inputs with no usable document are an error."""

from pathlib import Path

import pytest

from tessera.training import preprocess, tokenizer_cli
from tessera.training.indexed_dataset import IndexedDataset

BAD = b"\xff\xfe not utf-8 \xc3\n"  # 0xff never starts UTF-8; 0xc3 lacks its continuation byte


def write_bytes(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def prep(tmp_path: Path, tokenizer_path: Path, src: Path, prefix: Path, *extra: str) -> int:
    return preprocess.main(["--input", str(src), "--tokenizer", str(tokenizer_path),
                            "--output-prefix", str(prefix), *extra])


def test_preprocess_refuses_an_existing_output_unless_overwrite(tmp_path, tokenizer_path, capsys):
    src = write_bytes(tmp_path / "a.txt", b"first document\n\nsecond one\n")
    prefix = tmp_path / "out" / "corpus"
    assert prep(tmp_path, tokenizer_path, src, prefix) == 0
    before = Path(f"{prefix}.bin").read_bytes()
    write_bytes(src, b"another text entirely\n")
    capsys.readouterr()
    assert prep(tmp_path, tokenizer_path, src, prefix) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"tessera preprocess: error: {prefix}.bin already exists; pass "
                           "--overwrite to replace it, or choose another --output-prefix")
    assert Path(f"{prefix}.bin").read_bytes() == before
    assert prep(tmp_path, tokenizer_path, src, prefix, "--overwrite") == 0
    assert len(IndexedDataset(prefix)) == 1


def test_tokenizer_refuses_an_existing_output_unless_overwrite(tmp_path, documents, capsys):
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(documents))
    out = tmp_path / "tok.model"
    out.write_bytes(b"someone's tokenizer")
    argv = ["train", "--input", str(src), "--vocab-size", "400", "--output", str(out)]
    assert tokenizer_cli.main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"someone's tokenizer"
    assert tokenizer_cli.main([*argv, "--overwrite"]) == 0
    assert out.read_bytes() != b"someone's tokenizer"


def test_failed_runs_leave_no_new_directories(tmp_path, tokenizer_path, capsys):
    empty = write_bytes(tmp_path / "empty.txt", b"\n\n   \n")
    assert prep(tmp_path, tokenizer_path, empty, tmp_path / "new" / "deeper" / "corpus") == 1
    argv = ["train", "--input", str(empty), "--vocab-size", "400", "--output",
            str(tmp_path / "tok" / "dir" / "tok.model")]
    assert tokenizer_cli.main(argv) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


@pytest.mark.parametrize("name, good, bad_line, n_docs", [
    # text: the bad line sits inside the second paragraph, which joins the third's first line
    ("a.txt", b"a good paragraph\n\nanother good one\n", 4, 3),
    ("a.jsonl", b'{"text": "a good document"}\n{"text": "another"}\n', 3, 4),
])
def test_lines_that_are_not_utf8_are_skipped_and_reported(tmp_path, tokenizer_path, capsys, name,
                                                          good, bad_line, n_docs):
    src = write_bytes(tmp_path / name, good, BAD, good)
    assert prep(tmp_path, tokenizer_path, src, tmp_path / "o") == 0
    out = capsys.readouterr().out
    assert f"skipped 1 lines that are not UTF-8 (first at {src}:{bad_line})" in out
    assert len(IndexedDataset(tmp_path / "o")) == n_docs
    texts = list(preprocess.iter_documents(src))
    assert not any("\ufffd" in t or "not utf-8" in t for t in texts), texts
    stats = preprocess.preprocess([src], tokenizer_path, tmp_path / "o2", progress=False)
    assert (stats.not_utf8, stats.first_not_utf8) == (1, f"{src}:{bad_line}")


def test_tokenizer_reports_lines_that_are_not_utf8(tmp_path, documents, capsys):
    src = write_bytes(tmp_path / "c.txt", "\n\n".join(documents[:100]).encode(), b"\n", BAD, BAD)
    out = tmp_path / "tok.model"
    assert tokenizer_cli.main(["train", "--input", str(src), "--vocab-size", "400", "--output",
                               str(out)]) == 0
    line = len("\n\n".join(documents[:100]).splitlines()) + 1
    assert f"skipped 2 lines that are not UTF-8 (first at {src}:{line})" in capsys.readouterr().out


def test_inputs_without_documents_are_an_error(tmp_path, tokenizer_path, capsys):
    src = write_bytes(tmp_path / "a.jsonl", b'{"body": "wrong key"}\n', BAD)
    assert prep(tmp_path, tokenizer_path, src, tmp_path / "o") == 1
    err = capsys.readouterr().err
    assert "no documents to write" in err and "1 malformed lines skipped" in err
    assert "skipped 1 lines that are not UTF-8" in err and "--json-key" in err
    assert list(tmp_path.glob("o*")) == []
