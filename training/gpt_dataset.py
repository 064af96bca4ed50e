"""GPT pretraining samples over indexed datasets: packing, shuffling, splits and blending.

`GPTDataset` cuts the documents of one split of one `IndexedDataset` into samples of
`seq_len + 1` tokens that run across document boundaries (packing, no padding); consecutive
samples share one token, so every token is a target exactly once per epoch. Three index arrays
are built with numpy:
- `doc_idx`: the split's document ids, shuffled independently for each epoch, for as many
  epochs as `num_samples` needs;
- `sample_idx`: `(num_samples + 1, 2)` boundaries `(position in doc_idx, token offset)`;
  sample i spans boundary i to boundary i + 1, both ends included;
- `shuffle_idx`: a permutation of the samples.
They are cached as `.npy` files (default `PREFIX_cache/`, next to the data) under a key hashed
from everything they depend on, and written atomically (temporary file, then rename). Every rank
may build them: the result depends only on the data and the parameters, so concurrent builds
write identical files and all ranks read the same samples in the same order. No barrier needed.

`ds[i]` is `{"tokens": LongTensor(seq_len), "labels": LongTensor(seq_len)}`, where labels are
the tokens shifted left by one.

`BlendedDataset` interleaves several datasets by weight, greedily: sample i comes from the
dataset whose realized share lags its weight the most (ties go to the lower index), so every
prefix of the blend is as close to the weights as integer counts allow.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.core.files import atomic_file
from tessera.training.indexed_dataset import IndexedDataset

CACHE_VERSION = 1  # bump when the index construction changes, to orphan old caches
SPLIT_NAMES = ("train", "valid", "test")
Sample = dict[str, torch.Tensor]


def split_ranges(split: str | Sequence[float], num_docs: int) -> list[tuple[int, int]]:
    """Document ranges `[start, end)` for train/valid/test from ratios such as "98,1,1"."""
    parts = [float(x) for x in split.split(",")] if isinstance(split, str) else list(split)
    if not 1 <= len(parts) <= 3 or any(p < 0 or not math.isfinite(p) for p in parts):
        raise ValueError(f"split must be 1 to 3 non-negative ratios like '98,1,1', got {split!r}")
    if sum(parts) <= 0:
        raise ValueError(f"split ratios must not all be zero, got {split!r}")
    parts += [0.0] * (3 - len(parts))
    cumulative = np.cumsum(parts) / sum(parts)
    bounds = [0] + [round(c * num_docs) for c in cumulative]
    bounds[-1] = num_docs  # guard against float rounding at the end
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _key(params: dict[str, Any]) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    # atomic_file's temporary name is unique per writer: ranks building one cache never share it.
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


def _cached(
    cache_dir: Path | None,
    stem: str,
    build: Callable[[], dict[str, np.ndarray]],
    shapes: dict[str, tuple[int, ...] | None],
) -> tuple[dict[str, np.ndarray], bool]:
    """Load the arrays `stem-NAME.npy` from `cache_dir`, or build and save them.

    `shapes` gives the expected shape per array (None: any 1-D); a cache file that is
    unreadable or has the wrong shape is rebuilt. Returns (arrays, whether the cache was used).
    """
    files = {name: cache_dir / f"{stem}-{name}.npy" for name in shapes} if cache_dir else {}
    if files and all(f.is_file() for f in files.values()):
        try:
            arrays = {n: np.load(f, mmap_mode="r", allow_pickle=False) for n, f in files.items()}
            if all(arrays[n].shape == s if s is not None else arrays[n].ndim == 1 for n, s in shapes.items()):
                return arrays, True
        except (OSError, ValueError):
            pass  # damaged or foreign file: rebuild it below
        warnings.warn(f"rebuilding the damaged index cache {stem} in {cache_dir}", stacklevel=3)
    arrays = build()
    if cache_dir:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for name, f in files.items():
                _save_atomic(f, arrays[name])
        except OSError as exc:
            warnings.warn(
                f"cannot write the dataset index cache in {cache_dir} ({exc}); "
                "the indices stay in memory, rebuilt on every start",
                stacklevel=3,
            )
    return arrays, False


def _compact(array: np.ndarray) -> np.ndarray:
    """int32 when the values fit, halving the cache on disk."""
    fits = array.size == 0 or int(array.max()) < 2**31
    return array.astype(np.int32) if fits else array.astype(np.int64)


def _build_indices(
    lengths: np.ndarray, documents: tuple[int, int], seq_len: int, num_samples: int, seed: int
) -> dict[str, np.ndarray]:
    first, end = documents
    if num_samples == 0:
        empty = np.zeros(0, dtype=np.int32)
        return {"doc_idx": empty, "sample_idx": np.zeros((1, 2), np.int32), "shuffle_idx": empty}
    tokens_per_epoch = int(np.asarray(lengths[first:end], dtype=np.int64).sum())
    needed = num_samples * seq_len + 1  # boundaries overlap by one token; +1 for the last label
    epochs = math.ceil(needed / tokens_per_epoch)
    # RandomState, not default_rng: its stream is frozen across numpy releases, so a cache
    # rebuilt under another numpy still yields the same samples.
    rng = np.random.RandomState(seed)
    doc_ids = np.arange(first, end, dtype=np.int64)
    doc_idx = np.concatenate([rng.permutation(doc_ids) for _ in range(epochs)])
    ends = np.cumsum(lengths[doc_idx].astype(np.int64))  # exclusive end of each doc_idx entry
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    where = np.searchsorted(ends, positions, side="right")  # skips empty documents too
    offsets = positions - (ends[where] - lengths[doc_idx[where]])
    return {
        "doc_idx": _compact(doc_idx[: where[-1] + 1]),
        "sample_idx": _compact(np.stack([where, offsets], axis=1)),
        "shuffle_idx": _compact(rng.permutation(num_samples)),
    }


class GPTDataset(Dataset[Sample]):
    """`num_samples` packed samples of `seq_len` tokens (+1 for the labels) from one split.

    Args:
        indexed: the data, or its prefix.
        seq_len: tokens per sample.
        num_samples: samples wanted; the documents repeat for as many epochs as that takes.
        seed: the shuffling seed.
        documents: the `[start, end)` document range of this split (default: all).
        cache_dir: where index arrays are cached (default `PREFIX_cache/`).
        name: the split's name, used in cache file names and messages.
    """

    def __init__(
        self,
        indexed: IndexedDataset | str | os.PathLike[str],
        seq_len: int,
        num_samples: int,
        seed: int = 1234,
        documents: tuple[int, int] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        name: str = "train",
    ) -> None:
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        self.seq_len, self.num_samples, self.seed, self.name = seq_len, num_samples, seed, name
        self.documents = documents or (0, len(self.indexed))
        first, end = self.documents
        if seq_len < 1 or num_samples < 0 or not 0 <= first <= end <= len(self.indexed):
            raise ValueError(
                f"bad GPTDataset arguments: seq_len={seq_len}, num_samples={num_samples}, "
                f"documents={self.documents} of {len(self.indexed)}"
            )
        lengths = self.indexed.lengths
        if num_samples and int(np.asarray(lengths[first:end]).sum()) == 0:
            raise ValueError(
                f"the {name} split of {self.indexed.prefix} (documents {first}..{end}) has no "
                f"tokens, but {num_samples} samples were asked for: change the split or add data"
            )
        params = {
            # The document lengths identify the data: re-preprocessing invalidates the cache.
            "lengths": hashlib.blake2b(np.ascontiguousarray(lengths).data).hexdigest(),
            "documents": list(self.documents),
            "seq_len": seq_len,
            "num_samples": num_samples,
            "seed": seed,
        }
        cache = Path(cache_dir) if cache_dir is not None else Path(self.indexed.prefix + "_cache")
        arrays, self.cache_hit = _cached(
            cache,
            f"{name}-{_key(params)}",
            lambda: _build_indices(lengths, self.documents, seq_len, num_samples, seed),
            {"doc_idx": None, "sample_idx": (num_samples + 1, 2), "shuffle_idx": (num_samples,)},
        )
        self.doc_idx, self.sample_idx = arrays["doc_idx"], arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, i: int) -> np.ndarray:
        """The `seq_len + 1` tokens of sample i, as stored (no tensor conversion)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} {self.name} samples")
        s = int(self.shuffle_idx[i])
        (j0, o0), (j1, o1) = self.sample_idx[s].tolist(), self.sample_idx[s + 1].tolist()
        if j0 == j1:
            return self.indexed.get(int(self.doc_idx[j0]), o0, o1 - o0 + 1)
        parts = [self.indexed.get(int(self.doc_idx[j0]), o0)]
        parts += [self.indexed[int(self.doc_idx[j])] for j in range(j0 + 1, j1)]
        parts.append(self.indexed.get(int(self.doc_idx[j1]), 0, o1 + 1))
        return np.concatenate(parts)

    def __getitem__(self, i: int) -> Sample:
        tokens = torch.from_numpy(self.sample_tokens(i).astype(np.int64))
        return {"tokens": tokens[:-1], "labels": tokens[1:]}


@functools.lru_cache(maxsize=8)
def blend_indices(weights: tuple[float, ...], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) for each blended sample, greedily.

    A plain loop, ~0.3 s per million samples for three datasets; callers cache the result.
    """
    total = sum(weights)
    w = [x / total for x in weights]
    counts = [0] * len(w)
    picks = [0] * num_samples
    for i in range(num_samples):
        # The dataset whose count lags its share of i + 1 samples the most; first wins ties.
        best, best_lag = 0, w[0] * (i + 1) - counts[0]
        for k in range(1, len(w)):
            lag = w[k] * (i + 1) - counts[k]
            if lag > best_lag:
                best, best_lag = k, lag
        picks[i] = best
        counts[best] += 1
    which = np.array(picks, dtype=np.int32)
    within = np.empty(num_samples, dtype=np.int64)
    for k in range(len(w)):
        mask = which == k
        within[mask] = np.arange(int(mask.sum()))
    which.flags.writeable = within.flags.writeable = False  # shared by the lru_cache
    return which, within


class BlendedDataset(Dataset[Sample]):
    """`num_samples` samples interleaved from `datasets` in proportion to `weights`.

    Each dataset must hold at least the samples the blend takes from it (`blend_indices`
    tells how many; `build_datasets` sizes them exactly). The interleaving is deterministic,
    so it needs no seed: the randomness lives in each dataset's own shuffle.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset[Sample]],
        weights: Sequence[float],
        num_samples: int,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(weights)} for {len(datasets)}")
        if any(w <= 0 or not math.isfinite(w) for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        self.datasets, self.num_samples = list(datasets), num_samples
        self.weights = [w / sum(weights) for w in weights]
        key = tuple(float(w) for w in weights)
        arrays, _ = _cached(
            Path(cache_dir) if cache_dir is not None else None,
            f"blend-{_key({'weights': key, 'num_samples': num_samples})}",
            lambda: dict(zip(("dataset_index", "sample_index"), blend_indices(key, num_samples))),
            {"dataset_index": (num_samples,), "sample_index": (num_samples,)},
        )
        self.dataset_index, self.sample_index = arrays["dataset_index"], arrays["sample_index"]
        needs = np.bincount(self.dataset_index, minlength=len(datasets))
        sizes = [len(ds) for ds in self.datasets]  # type: ignore[arg-type]
        for k, (size, need) in enumerate(zip(sizes, needs)):
            if size < need:
                raise ValueError(f"blended dataset {k} has {size} samples; the blend needs {need}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Sample:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


def parse_data_args(args: Sequence[str]) -> list[tuple[float, str]]:
    """`["0.7", "A", "0.3", "B"]` -> [(0.7, "A"), (0.3, "B")]; `["A"]` -> [(1.0, "A")].

    A bare list of several prefixes is weighted by each dataset's token count.
    """

    def is_number(s: str) -> bool:
        try:
            float(s)
        except ValueError:
            return False
        return True

    args = list(args)
    if not args:
        raise ValueError("no data given: expected PREFIX or WEIGHT PREFIX [WEIGHT PREFIX ...]")
    if not any(is_number(a) for a in args):
        if len(args) == 1:
            return [(1.0, args[0])]
        sizes = [IndexedDataset(prefix).num_tokens for prefix in args]
        return [(size / sum(sizes), prefix) for size, prefix in zip(sizes, args)]
    pairs = list(zip(args[0::2], args[1::2]))
    if len(args) % 2 or not all(is_number(w) and not is_number(p) for w, p in pairs):
        raise ValueError(f"expected WEIGHT PREFIX pairs like '0.7 A 0.3 B', got {' '.join(args)}")
    weighted = [(float(w), p) for w, p in pairs]
    if any(w <= 0 or not math.isfinite(w) for w, _ in weighted):
        raise ValueError(f"data weights must be positive, got {' '.join(args)}")
    return weighted


def build_datasets(
    data_args: Sequence[str],
    seq_len: int,
    split: str,
    num_samples: Sequence[int],
    seed: int = 1234,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Dataset[Sample] | None, Dataset[Sample] | None, Dataset[Sample] | None]:
    """Train, valid and test GPT datasets (None where 0 samples are asked) from `--data`
    arguments, split and blended by `build_split_datasets`."""

    def part(ds: IndexedDataset, n: int, docs: tuple[int, int], name: str) -> Dataset[Sample]:
        return GPTDataset(ds, seq_len, n, seed, docs, cache_dir, name)

    return build_split_datasets(data_args, split, num_samples, part, cache_dir)


PartFactory = Callable[[IndexedDataset, int, tuple[int, int], str], Dataset]


def build_split_datasets(
    data_args: Sequence[str],
    split: str,
    num_samples: Sequence[int],
    make_part: PartFactory,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets (None where 0 samples are asked) from `--data` arguments,
    for any sample kind: `make_part(indexed, num_samples, doc_range, split_name)` builds one
    prefix's dataset over its documents `doc_range` (GPT windows, T5 span corruption, ...).

    Each prefix is split by documents with the same `split` ratios; with several prefixes each
    split is a `BlendedDataset` whose parts are sized exactly to what the blend takes.
    """
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must give train, valid, test counts, got {num_samples}")
    blend = parse_data_args(data_args)
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    ranges = [split_ranges(split, len(ds)) for ds in indexed]
    weights = tuple(w for w, _ in blend)
    result: list[Dataset | None] = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if n <= 0:
            result.append(None)
            continue
        counts = np.bincount(blend_indices(weights, n)[0], minlength=len(blend)) if len(blend) > 1 else [n]
        parts = [make_part(ds, int(c), ranges[k][s], name)
                 for k, (ds, c) in enumerate(zip(indexed, counts))]
        if len(parts) == 1:
            result.append(parts[0])
        else:
            blend_cache = cache_dir if cache_dir is not None else indexed[0].prefix + "_cache"
            result.append(BlendedDataset(parts, weights, n, blend_cache))
    return result[0], result[1], result[2]
