"""GPT samples: packing across documents, epochs, splits, caching, blending, rank agreement.

The synthetic datasets number their tokens consecutively across documents (document d holds
`starts[d], starts[d] + 1, ...`), so a token tells which document and position it came from.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.training.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    blend_indices,
    build_datasets,
    parse_data_args,
    split_ranges,
)
from tessera.training.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def make_dataset(prefix: Path, lengths: list[int], first_token: int = 0) -> IndexedDataset:
    starts = first_token + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    with IndexedDatasetWriter(prefix, vocab_size=100_000) as writer:
        for start, n in zip(starts, lengths):
            writer.add_document(np.arange(start, start + n))
    return IndexedDataset(prefix)


@pytest.fixture()
def data(tmp_path: Path) -> IndexedDataset:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 60).tolist()
    lengths[5] = 0  # empty documents must not break the packing
    return make_dataset(tmp_path / "d", lengths)


def _all_samples(ds: GPTDataset | BlendedDataset) -> np.ndarray:
    return np.stack([ds[i]["tokens"].numpy() for i in range(len(ds))])


def test_items_are_long_tensors_with_shifted_labels(data: IndexedDataset):
    ds = GPTDataset(data, seq_len=16, num_samples=50, seed=1)
    item = ds[3]
    assert set(item) == {"tokens", "labels"}
    assert item["tokens"].dtype == torch.long and item["tokens"].shape == (16,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    whole = torch.from_numpy(ds.sample_tokens(3).astype(np.int64))  # seq_len + 1 tokens
    assert torch.equal(item["tokens"], whole[:-1]) and torch.equal(item["labels"], whole[1:])


def test_one_epoch_makes_every_token_a_target_exactly_once(tmp_path: Path):
    lengths = [5, 0, 13, 7, 1, 20, 3, 9, 6]  # 64 tokens; 63 = 7 * 9 targets
    data = make_dataset(tmp_path / "d", lengths)
    ds = GPTDataset(data, seq_len=9, num_samples=7, seed=3)
    labels = np.concatenate([ds[i]["labels"].numpy() for i in range(len(ds))])
    firsts = [ds[i]["tokens"][0].item() for i in range(len(ds))]
    assert len(set(labels.tolist())) == len(labels) == 63  # no target twice
    assert set(labels.tolist()) | set(firsts) == set(range(64))  # and none left out


def test_samples_run_through_documents_in_order(data: IndexedDataset):
    ends = set((data.offsets + data.lengths - 1).tolist())  # last token of each document
    starts = set(data.offsets[data.lengths > 0].tolist())
    ds = GPTDataset(data, seq_len=32, num_samples=40, seed=5)
    for i in range(len(ds)):
        t = ds.sample_tokens(i).tolist()
        for a, b in zip(t, t[1:]):
            # inside a document tokens are consecutive; otherwise a document ended and one began
            assert b == a + 1 or (a in ends and b in starts), (i, a, b)


def test_epochs_repeat_documents_each_in_a_new_order(data: IndexedDataset):
    n_docs = len(data)
    ds = GPTDataset(data, seq_len=64, num_samples=100, seed=7)  # ~6400 tokens: several epochs
    assert len(ds.doc_idx) > 3 * n_docs
    epochs = [ds.doc_idx[e * n_docs : (e + 1) * n_docs] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n_docs))
    assert epochs[0].tolist() != epochs[1].tolist()
    assert sorted(ds.shuffle_idx.tolist()) == list(range(100))


def test_same_parameters_same_samples_with_or_without_cache(data: IndexedDataset, tmp_path: Path):
    cache = tmp_path / "cache"
    first = GPTDataset(data, 16, 80, seed=11, cache_dir=cache)
    assert not first.cache_hit and len(list(cache.glob("*.npy"))) == 3
    second = GPTDataset(data, 16, 80, seed=11, cache_dir=cache)
    assert second.cache_hit
    for f in cache.glob("*.npy"):
        f.unlink()
    third = GPTDataset(IndexedDataset(data.prefix), 16, 80, seed=11, cache_dir=cache)
    assert not third.cache_hit
    reference = _all_samples(first)
    np.testing.assert_array_equal(_all_samples(second), reference)
    np.testing.assert_array_equal(_all_samples(third), reference)
    other = GPTDataset(data, 16, 80, seed=12, cache_dir=cache)
    assert not np.array_equal(_all_samples(other), reference)


def test_default_cache_sits_next_to_the_data(data: IndexedDataset):
    GPTDataset(data, 16, 10, seed=1, name="valid")
    assert len(list(Path(data.prefix + "_cache").glob("valid-*-shuffle_idx.npy"))) == 1


def test_damaged_cache_is_rebuilt(data: IndexedDataset, tmp_path: Path):
    reference = _all_samples(GPTDataset(data, 16, 30, seed=2, cache_dir=tmp_path))
    shuffle = next(tmp_path.glob("*shuffle_idx.npy"))
    shuffle.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="rebuilding"):
        again = GPTDataset(data, 16, 30, seed=2, cache_dir=tmp_path)
    np.testing.assert_array_equal(_all_samples(again), reference)


_RANK_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    from tessera.training.gpt_dataset import GPTDataset
    ds = GPTDataset(sys.argv[1], 16, 500, seed=9, cache_dir=sys.argv[2])
    tokens = np.stack([ds.sample_tokens(i) for i in range(len(ds))])
    print(hashlib.sha256(tokens.tobytes()).hexdigest())
    """
)


def test_concurrent_ranks_build_the_same_samples(data: IndexedDataset, tmp_path: Path):
    cache = tmp_path / "shared_cache"  # both "ranks" build into the same, empty cache at once
    cmd = [sys.executable, "-c", _RANK_SCRIPT, data.prefix, str(cache)]
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    digests = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    here = GPTDataset(data, 16, 500, seed=9, cache_dir=cache)
    assert here.cache_hit and len(list(cache.iterdir())) == 3  # no temporary files left
    expected = np.stack([here.sample_tokens(i) for i in range(len(here))])
    assert digests[0] == digests[1] == hashlib.sha256(expected.tobytes()).hexdigest()


def test_split_ranges():
    assert split_ranges("98,1,1", 100) == [(0, 98), (98, 99), (99, 100)]
    assert split_ranges("1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges([0.5, 0.5], 7) == [(0, 4), (4, 7), (7, 7)]
    for bad in ("0,0,0", "-1,2,1", "1,1,1,1", "a,b"):
        with pytest.raises(ValueError):
            split_ranges(bad, 10)


def test_splits_use_disjoint_documents(data: IndexedDataset, tmp_path: Path):
    train, valid, test = build_datasets([data.prefix], 8, "80,10,10", (40, 10, 0), 3, tmp_path)
    assert test is None and isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    boundary = int(data.offsets[48])  # documents 0..47 train, 48..53 valid
    assert _all_samples(train).max() < boundary
    assert boundary <= _all_samples(valid).min() < int(data.offsets[54])


def test_asking_samples_of_an_empty_split_is_a_clear_error(data: IndexedDataset, tmp_path: Path):
    with pytest.raises(ValueError, match="valid split .* has no tokens"):
        build_datasets([data.prefix], 8, "100,0,0", (10, 5, 0), 1, tmp_path)


def test_blend_indices_follow_weights_at_every_prefix():
    which, within = blend_indices((0.6, 0.3, 0.1), 10_000)
    for n in (100, 1000, 10_000):
        shares = np.bincount(which[:n], minlength=3) / n
        np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.01)
    for k in range(3):  # each dataset's samples are taken in order, each exactly once
        assert within[which == k].tolist() == list(range(int((which == k).sum())))


def test_blended_dataset_honours_weights_over_real_datasets(tmp_path: Path):
    a = make_dataset(tmp_path / "a", [30] * 40)  # tokens 0..1199
    b = make_dataset(tmp_path / "b", [25] * 40, first_token=10_000)
    args = ["0.7", a.prefix, "0.3", b.prefix]
    train, _, _ = build_datasets(args, 4, "1", (10_000, 0, 0), 5, tmp_path / "c")
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    from_a = np.mean([train[i]["tokens"][0].item() < 10_000 for i in range(len(train))])
    assert abs(from_a - 0.7) < 0.01
    again, _, _ = build_datasets(args, 4, "1", (10_000, 0, 0), 5, tmp_path / "c")
    np.testing.assert_array_equal(_all_samples(again)[:500], _all_samples(train)[:500])


def test_blend_refuses_datasets_that_are_too_small(data: IndexedDataset):
    small = GPTDataset(data, 8, 10, seed=1)
    with pytest.raises(ValueError, match="has 10 samples; the blend needs"):
        BlendedDataset([small, small], [0.5, 0.5], 100)
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset([small, small], [1.0, 0.0], 10)


def test_parse_data_args(tmp_path: Path):
    assert parse_data_args(["A"]) == [(1.0, "A")]
    assert parse_data_args(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    a = make_dataset(tmp_path / "a", [30, 30])
    b = make_dataset(tmp_path / "b", [20])
    assert parse_data_args([a.prefix, b.prefix]) == [(0.75, a.prefix), (0.25, b.prefix)]
    for bad in ([], ["0.5", "A", "B"], ["A", "0.5"], ["0.5", "A", "-1", "B"]):
        with pytest.raises(ValueError):
            parse_data_args(bad)
