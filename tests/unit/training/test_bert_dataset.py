"""BERT masked-LM data over an indexed dataset: the masking statistics over 10k samples are
within 1% (absolute) of 15% / 80-10-10 and 50% random next sentences, the layout of every sample
is `[CLS] A [SEP] B [SEP] [PAD]...` with matching token types and padding mask, a second build
(from the index cache) gives identical samples in any read order, and a vocabulary without room
for the special tokens is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.training.bert_dataset import MaskingConfig, bert_specials, build_bert_datasets
from tessera.training.indexed_dataset import IndexedDatasetWriter

V, SEQ, N = 200, 64, 10_000


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("bert-data") / "corpus"
    with IndexedDatasetWriter(prefix, V) as writer:
        for _ in range(400):
            writer.add_document(rng.integers(0, V, size=int(rng.integers(5, 120))))
    return str(prefix)


def _build(prefix: str, nsp: bool = True):
    return build_bert_datasets([prefix], SEQ, "95,5,0", [N, 10, 0], bert_specials(V), seed=3,
                               masking=MaskingConfig(nsp=nsp))[0]


def test_masking_statistics_and_sample_layout(prefix):
    ds, sp = _build(prefix), bert_specials(V)
    samples = [ds[i] for i in range(N)]
    tokens, labels, types, mask = (torch.stack([s[k] for s in samples]).numpy() for k in
                                   ("tokens", "labels", "token_types", "attention_mask"))
    nsp = torch.stack([s["next_sentence"] for s in samples]).numpy()
    used = mask.sum(1)
    pos = np.arange(SEQ)
    is_sep = tokens == sp.sep
    first_sep = is_sep.argmax(1)
    assert (tokens[:, 0] == sp.cls).all() and (is_sep.sum(1) == 2).all()
    assert (tokens[np.arange(N), used - 1] == sp.sep).all()
    assert (mask == (pos < used[:, None])).all() and ((tokens == sp.pad) == (mask == 0)).all()
    assert (types == ((pos > first_sep[:, None]) & (mask == 1))).all()
    chosen = labels != -100
    special = (tokens >= V) & (tokens != sp.mask)  # [CLS], [SEP], [PAD]: never picked
    assert not (chosen & special).any() and (labels[chosen] < V).all()
    picked = chosen.sum()
    masked = (tokens[chosen] == sp.mask).sum()
    kept = (tokens[chosen] == labels[chosen]).sum()
    stats = {"masked share": (picked / (used - 3).sum(), 0.15), "[MASK]": (masked / picked, 0.8),
             "kept": (kept / picked, 0.1), "random": (1 - (masked + kept) / picked, 0.1),
             "random next": (nsp.mean(), 0.5), "short": ((used < SEQ).mean(), 0.1)}
    for name, (got, want) in stats.items():
        assert abs(got - want) <= 0.01, (name, got, want)
    # A second build (the index cache now exists), read backwards, gives the same samples.
    again = _build(prefix)
    assert again.windows.cache_hit
    for i in reversed(range(0, N, 97)):
        assert all(torch.equal(again[i][k], samples[i][k]) for k in samples[i]), i


def test_without_nsp_no_label_and_b_follows_a(prefix):
    ds = _build(prefix, nsp=False)
    s = ds[5]
    assert "next_sentence" not in s
    sp = bert_specials(V)
    used = int(s["attention_mask"].sum())
    window = ds._window(5)
    tokens, labels = s["tokens"].clone(), s["labels"]
    tokens[labels != -100] = labels[labels != -100]  # undo the masking
    body = tokens[:used][(tokens[:used] != sp.cls) & (tokens[:used] != sp.sep)]
    assert body.tolist() == window[: len(body)].tolist()


def test_a_vocabulary_without_room_for_specials_is_refused():
    assert bert_specials(320).vocab_size == 324 and bert_specials(320, 324).mask == 322
    with pytest.raises(ValueError, match="set vocab_size to at least 324"):
        bert_specials(320, 321)
