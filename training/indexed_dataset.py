"""Indexed binary token datasets: `PREFIX.bin` holds the tokens, `PREFIX.idx` says where each
document starts.

File format (version 1, all integers little-endian):

- `PREFIX.bin`: every document's token ids, concatenated, no separators or padding. The dtype is
  uint16 when the vocabulary has fewer than 65,500 ids (a little headroom below 2**16), else int32.
- `PREFIX.idx`: a 40-byte header, then two arrays:
    magic       8 bytes   b"TSRIDX\\x00\\x00"
    version     uint32    1
    dtype code  uint8     1 = uint16, 2 = int32; then 3 zero bytes
    vocab_size  uint64    the tokenizer's vocabulary size, to catch a tokenizer mismatch
    num_docs    uint64
    num_tokens  uint64
    offsets     int64[num_docs]   token offset of each document in PREFIX.bin
    lengths     int32[num_docs]   token count of each document
  The offsets come first so they sit 8-byte aligned for the memory map.

`IndexedDatasetWriter` streams documents in and publishes both files atomically (temporary
files, then rename) in `finalize()`; `IndexedDataset` memory-maps them and validates the header
and sizes on open, naming the file and the fix when something does not add up.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import numpy as np

MAGIC = b"TSRIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xQQQ")  # magic, version, dtype code, vocab, docs, tokens
HEADER_SIZE = _HEADER.size
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_REDO = "re-run `tessera preprocess` to rebuild it"


class _HasVocab(Protocol):
    @property
    def vocab_size(self) -> int: ...


def dtype_for_vocab(vocab_size: int) -> np.dtype[Any]:
    """The token dtype used on disk for a vocabulary of `vocab_size` ids."""
    return DTYPES[1] if vocab_size < 65_500 else DTYPES[2]


def dataset_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = str(prefix)
    if p.endswith((".bin", ".idx")):  # accept a path to either file as well as the prefix
        p = p[:-4]
    return Path(p + ".bin"), Path(p + ".idx")


class IndexedDatasetWriter:
    """Stream documents into `PREFIX.bin` / `PREFIX.idx`.

    Tokens go straight to a temporary .bin file; only 4 bytes per document stay in memory.
    Nothing is visible under the final names until `finalize()` succeeds. Use as a context
    manager to finalize on success and discard the temporary files on error.
    """

    def __init__(self, prefix: str | os.PathLike[str], vocab_size: int) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")  # closed by finalize() or discard()
        self._lengths = array("i")
        self._num_tokens = 0

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document. Raises ValueError if an id is outside `[0, vocab_size)`."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of ids, got shape {arr.shape}")
        self.add_documents(arr, np.array([arr.size]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: `tokens` concatenated, `lengths` summing to its size.

        Same result as `add_document` per document, with one range check and one write.
        """
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != tokens.size:
            raise ValueError("tokens must be 1-D and lengths must sum to len(tokens)")
        if lengths.size and (lengths.min() < 0 or lengths.max() >= 2**31):
            raise ValueError("document lengths must lie in [0, 2**31)")
        self._check_range(tokens)
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths.astype(np.int32).tolist())
        self._num_tokens += tokens.size

    def _check_range(self, arr: np.ndarray) -> None:
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got {arr.min()}..{arr.max()}")

    def finalize(self) -> None:
        """Write the index and publish both files under their final names."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        offsets = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1], out=offsets[1:])
        code = next(c for c, d in DTYPES.items() if d == self.dtype)
        header = _HEADER.pack(MAGIC, VERSION, code, self.vocab_size, len(lengths), self._num_tokens)
        with open(self._idx_tmp, "wb") as f:
            f.write(header)
            f.write(offsets.tobytes())
            f.write(lengths.astype("<i4").tobytes())
            f.flush()
            os.fsync(f.fileno())
        # .bin first: a crash between the renames leaves an old .idx whose sizes no longer
        # match the new .bin, which the reader reports instead of reading garbage.
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def discard(self) -> None:
        """Drop everything written so far; the final files are left untouched."""
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


class IndexedDataset:
    """A read-only, memory-mapped view of `PREFIX.bin` / `PREFIX.idx`.

    `ds[i]` is document i as a numpy array (a view into the map, no copy). Pickling keeps only
    the prefix, so DataLoader workers reopen the maps instead of copying the data.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.prefix = str(self.bin_path)[:-4]
        self._open()

    def _open(self) -> None:
        idx, bin_ = self.idx_path, self.bin_path
        for path in (idx, bin_):
            if not path.is_file():
                raise FileNotFoundError(
                    f"missing dataset file {path}: expected both PREFIX.bin and PREFIX.idx "
                    f"from `tessera preprocess --output-prefix {self.prefix}`"
                )
        idx_size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise ValueError(f"{idx} is truncated ({idx_size} bytes, header alone is 40); {_REDO}")
        magic, version, code, vocab, num_docs, num_tokens = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError(f"{idx} is not a Tessera index file (bad magic {magic!r}); {_REDO}")
        if version != VERSION:
            raise ValueError(f"{idx} has format version {version}, this Tessera reads {VERSION}; {_REDO}")
        if code not in DTYPES:
            raise ValueError(f"{idx} names an unknown token dtype code {code}; {_REDO}")
        expected_idx = HEADER_SIZE + 12 * num_docs
        if idx_size != expected_idx:
            raise ValueError(
                f"{idx} has {idx_size} bytes but its header describes {num_docs} documents "
                f"({expected_idx} bytes): the file is truncated or corrupt; {_REDO}"
            )
        self.dtype = DTYPES[code]
        self.vocab_size = int(vocab)
        self.num_tokens = int(num_tokens)
        bin_size = bin_.stat().st_size
        if bin_size != num_tokens * self.dtype.itemsize:
            raise ValueError(
                f"{bin_} has {bin_size} bytes but {idx} describes {num_tokens} tokens "
                f"({num_tokens * self.dtype.itemsize} bytes): one file is truncated or they "
                f"come from different runs; {_REDO}"
            )
        n = int(num_docs)
        if n:
            self.offsets = np.memmap(idx, "<i8", "r", offset=HEADER_SIZE, shape=(n,))
            self.lengths = np.memmap(idx, "<i4", "r", offset=HEADER_SIZE + 8 * n, shape=(n,))
            if self.offsets[-1] + self.lengths[-1] != num_tokens or self.offsets[0] != 0:
                raise ValueError(f"{idx} has document offsets inconsistent with its size; {_REDO}")
        else:
            self.offsets = np.zeros(0, dtype="<i8")
            self.lengths = np.zeros(0, dtype="<i4")
        # np.memmap refuses empty files, and an empty dataset is legal.
        if num_tokens:
            self._tokens = np.memmap(bin_, self.dtype, "r", shape=(self.num_tokens,))
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, doc: int) -> np.ndarray:
        return self.get(doc)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc` (to its end if length is None)."""
        n = len(self)
        if not -n <= doc < n:
            raise IndexError(f"document {doc} out of range for {n} documents in {self.prefix}")
        doc %= n
        doc_len = int(self.lengths[doc])
        if length is None:
            length = doc_len - offset
        if offset < 0 or length < 0 or offset + length > doc_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for document {doc} of length {doc_len}"
            )
        start = int(self.offsets[doc]) + offset
        return self._tokens[start : start + length]

    def check_vocab(self, tokenizer: _HasVocab | int) -> None:
        """Raise ValueError unless the data was made with this tokenizer's vocabulary size."""
        size = tokenizer if isinstance(tokenizer, int) else tokenizer.vocab_size
        if size != self.vocab_size:
            raise ValueError(
                f"{self.prefix} was tokenized with a vocabulary of {self.vocab_size} ids but "
                f"the tokenizer has {size}: this data belongs to another tokenizer; re-run "
                "`tessera preprocess` with the model's tokenizer"
            )

    def __getstate__(self) -> dict[str, str]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, "
            f"vocab_size={self.vocab_size})"
        )
