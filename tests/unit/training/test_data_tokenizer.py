"""The tokenizer wrapper (`tessera.core.tokenizer`) and `tessera tokenizer train`."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.core.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    tokenizer_from_bytes,
    train_tokenizer,
)
from tessera.training import tokenizer_cli


def test_trained_model_has_exact_vocab_and_fixed_special_ids(tokenizer: SentencePieceTokenizer):
    assert tokenizer.vocab_size == 400
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 3)
    assert tokenizer.eod_id == tokenizer.eos_id == 2


def test_encode_adds_bos_eos_only_when_asked(tokenizer: SentencePieceTokenizer):
    plain = tokenizer.encode("the model learns")
    assert 1 not in plain and 2 not in plain
    assert tokenizer.encode("the model learns", bos=True, eos=True) == [1, *plain, 2]


@pytest.mark.parametrize(
    "text",
    ["The model learns.", "  leading and  double spaces ", "line one\nline two\n\n", "emoji 🦀 ü"],
)
def test_decode_inverts_encode_even_for_unseen_characters(tokenizer: SentencePieceTokenizer, text: str):
    # identity normalization + byte fallback: nothing is lost, nothing becomes <unk>
    ids = tokenizer.encode(text)
    assert 0 not in ids
    assert tokenizer.decode(ids) == text


def test_decode_rejects_ids_outside_vocab(tokenizer: SentencePieceTokenizer):
    with pytest.raises(ValueError, match="400"):
        tokenizer.decode([5, 400])


def test_save_load_bytes_and_pickle_round_trip(tokenizer: SentencePieceTokenizer, tmp_path: Path):
    saved = tokenizer.save(tmp_path)  # a directory: the default file name inside it
    assert saved == tmp_path / "tokenizer.model"
    text = "Parallel pipeline 2024 café"
    for other in (
        load_tokenizer(tmp_path),
        load_tokenizer(saved),
        tokenizer_from_bytes(tokenizer.model_bytes(), "sentencepiece"),
        pickle.loads(pickle.dumps(tokenizer)),
    ):
        assert other.encode(text) == tokenizer.encode(text)
        assert other.model_bytes() == tokenizer.model_bytes()


def test_load_errors_name_the_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        load_tokenizer(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="no tokenizer.model"):
        load_tokenizer(tmp_path)  # an empty directory
    garbage = tmp_path / "bad.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model is not a valid sentencepiece model"):
        load_tokenizer(garbage)


def test_unigram_trains_to_exact_size(documents: list[str], tmp_path: Path):
    tok = train_tokenizer([], 330, tmp_path / "u.model", "unigram", texts=documents, num_threads=1)
    assert tok.vocab_size == 330 == load_tokenizer(tmp_path / "u.model").vocab_size
    with pytest.raises(ValueError, match=r"vocab_size=300 cannot hold .*\(\d+ in all\)"):
        train_tokenizer([], 300, tmp_path / "u.model", "unigram", texts=documents)


def test_input_files_plain_and_gz_are_read(documents: list[str], tmp_path: Path):
    (tmp_path / "a.txt").write_text("\n\n".join(documents[:120]))
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("\n".join(documents[120:]))
    tok = train_tokenizer([tmp_path / "a.txt", tmp_path / "b.txt.gz"], 400, tmp_path / "t.model")
    assert tok.vocab_size == 400


def test_jsonl_inputs_train_on_the_text_field_only(documents: list[str], tmp_path: Path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d, "meta": "x"}) + "\n" for d in documents) + "{bad\n")
    from_file = train_tokenizer([src], 400, tmp_path / "f.model", num_threads=1)
    from_texts = train_tokenizer([], 400, tmp_path / "t.model", texts=documents, num_threads=1)
    assert from_file.model_bytes() == from_texts.model_bytes()  # no JSON syntax learned


def test_too_small_corpus_and_bad_arguments_are_clear_errors(tmp_path: Path):
    with pytest.raises(ValueError, match=r"too small for vocab_size=5000.*at most \d+"):
        train_tokenizer([], 5000, tmp_path / "t.model", texts=["a tiny corpus", "of two lines"])
    with pytest.raises(ValueError, match="at least 261"):
        train_tokenizer([], 100, tmp_path / "t.model", texts=["text"])
    with pytest.raises(ValueError, match="inputs are empty"):
        train_tokenizer([], 300, tmp_path / "t.model", texts=["", "  "])
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer([], 300, tmp_path / "t.model", "wordpiece", texts=["text"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_tokenizer([tmp_path / "missing.txt"], 300, tmp_path / "t.model")

    def failing_texts():
        yield from ["some text"] * 100
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="the disk went away"):  # not sentencepiece's RuntimeError
        train_tokenizer([], 300, tmp_path / "t.model", texts=failing_texts())
    assert not (tmp_path / "t.model").exists()


def _write_hf_tokenizer(directory: Path, documents: list[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"])
    raw.train_from_iterator(documents, trainer)
    # A post-processor that would add <s>: the wrapper must not let it act unasked.
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(directory / "tokenizer.json"))


def test_hf_tokenizer_json_follows_the_same_contract(documents: list[str], tmp_path: Path):
    _write_hf_tokenizer(tmp_path, documents)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.eod_id) == (0, 1, 2, 2)
    text = "The model learns tokens"
    ids = tok.encode(text)
    assert 1 not in ids and tok.decode(ids) == text
    assert tok.encode(text, bos=True, eos=True) == [1, *ids, 2]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(text) == ids
    assert tokenizer_from_bytes(tok.model_bytes(), "huggingface").encode(text) == ids


def test_hf_tokenizer_config_names_the_specials(documents: list[str], tmp_path: Path):
    _write_hf_tokenizer(tmp_path, documents)
    config = {"eos_token": {"content": "<pad>"}, "bos_token": "</s>", "pad_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.eos_id, tok.bos_id) == (0, 2)


def test_cli_trains_from_jsonl_gz_and_counts_bad_lines(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    src = tmp_path / "c.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in documents)
        f.write("{not json\n")
    out = tmp_path / "tok.model"
    argv = ["train", "--input", str(src), "--vocab-size", "350", "--output", str(out)]
    assert tokenizer_cli.main([*argv, "--json-key", "body"]) == 0
    assert load_tokenizer(out).vocab_size == 350
    assert f"skipped 1 malformed JSONL lines; first: {src}:{len(documents) + 1}" in (capsys.readouterr().out)
    missing = ["train", "--input", str(tmp_path / "missing.txt"), "--vocab-size", "300"]
    assert tokenizer_cli.main([*missing, "--output", str(out)]) == 1
    assert "input file not found" in capsys.readouterr().err


def test_cli_help_runs_through_python_m_tessera(capsys: pytest.CaptureFixture[str]):
    result = subprocess.run(
        [sys.executable, "-m", "tessera", "tokenizer", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: tessera tokenizer" in result.stdout and "train" in result.stdout
    with pytest.raises(SystemExit) as exit_info:  # the subcommand's help, in process (fast)
        tokenizer_cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--vocab-size" in out and "--model-type" in out and "--json-key" in out
