"""`tessera evaluate`: the split is cut as pretraining cut it, the loss is the model's own mean
cross-entropy over the same windows, and documents are read only as far as scoring needs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera.core.checkpoint import load_checkpoint
from tessera.training import evaluate as ev
from tessera.training import evaluate_cli
from tessera.training.config import load_config
from tessera.training.indexed_dataset import IndexedDataset
from tessera.training.loop import pretrain
from tests.pretrain_helper import TinyData, pretrain_argv


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-step run whose documents were split 50/25/25 (so the splits are easy to tell)."""
    run = tmp_path_factory.mktemp("run") / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, "--steps", "2", "--split", "50,25,25"))
    return pretrain(cfg)["checkpoint"]


def _reference(checkpoint: str, docs: list[np.ndarray], seq_len: int, n: int) -> float:
    """The mean cross-entropy of the first `n` windows, one window per forward pass, from the
    model's logits (not its loss path)."""
    model = load_checkpoint(checkpoint)
    tokens = torch.from_numpy(np.concatenate(docs).astype(np.int64))
    losses = []
    with torch.no_grad():
        for i in range(n):
            w = tokens[i * seq_len: i * seq_len + seq_len + 1]
            logits = model(w[None, :-1])
            losses.append(F.cross_entropy(logits[0].float(), w[1:], reduction="sum"))
    return float(sum(losses)) / (n * seq_len)


@pytest.mark.parametrize(("split", "first", "end"), [("test", 450, 600), ("valid", 300, 450),
                                                     ("all", 0, 600)])
def test_scores_the_split_as_pretraining_cut_it(tiny, checkpoint, capsys, split, first, end):
    ds = IndexedDataset(tiny.prefix)
    assert len(ds) == 600  # 50/25/25 of 600 documents: by hand, 0-300, 300-450, 450-600
    argv = ["--checkpoint", checkpoint, "--data", str(tiny.prefix), "--seq-len", "32",
            "--batch", "3", "--max-windows", "7", "--json"]
    if split != "test":  # test is the default
        argv += ["--split", split]
    assert evaluate_cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == split and result["split_ratios"] == "50,25,25"
    assert result["tokens"] == 7 * 32
    want = _reference(checkpoint, [ds[i] for i in range(first, end)], 32, 7)
    assert result["loss"] == pytest.approx(want, rel=1e-5)


def test_stops_reading_documents_after_max_windows(checkpoint):
    read = []

    def documents():
        for i in range(10_000):
            read.append(i)
            yield np.arange(i % 7, i % 7 + 10, dtype=np.uint16)

    model = load_checkpoint(checkpoint)
    result = ev.evaluate(model, documents(), seq_len=16, batch=4, max_windows=5)
    assert result["tokens"] == 5 * 16
    assert len(read) <= (5 * 16 + 1) // 10 + 1  # only the documents the 5 windows span


def test_windows_match_slicing_one_tensor():
    docs = [np.arange(n, dtype=np.int32) + 100 * n for n in (3, 40, 1, 17, 9)]
    flat = torch.from_numpy(np.concatenate(docs).astype(np.int64))
    got = list(ev.windows(docs, 8))
    n = (len(flat) - 1) // 8
    assert len(got) == n
    for i, w in enumerate(got):
        assert torch.equal(w, flat[i * 8: i * 8 + 9])
    assert len(list(ev.windows(docs, 8, max_windows=3))) == 3


def test_text_documents_split_as_a_whole_read_would(tmp_path, monkeypatch):
    text = "one\n\ntwo\nlines\n\n\nthree\n \n\n\n\nfour\n\n"
    path = tmp_path / "docs.txt"
    path.write_text(text)
    want = [d for d in text.split("\n\n") if d.strip()]
    for block in (1, 2, 3, 5, 1000):
        monkeypatch.setattr(ev, "_BLOCK", block)
        assert list(ev._documents(Path(path), "text")) == want, block


def test_too_few_tokens_is_a_clear_error(tiny, checkpoint, capsys):
    assert evaluate_cli.main(["--checkpoint", checkpoint, "--data", str(tiny.prefix), "--seq-len",
                    "100000"]) == 2
    assert "fewer than 100001 tokens" in capsys.readouterr().err
