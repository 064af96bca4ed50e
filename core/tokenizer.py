"""The tokenizer wrapper: one small interface over sentencepiece and Hugging Face tokenizers.

Contract:
- `Tokenizer.encode(text, bos=False, eos=False)` never adds special tokens on its own; BOS and
  EOS are added only when asked, so every backend behaves the same.
- `bos_id` and `eos_id` are `None` when the model has no such token. `adds_bos` says whether a
  text prompt starts with BOS (what `tessera serve` runs): for a sentencepiece model whenever it
  has one; for a `tokenizer.json` as its post-processor says, which is what transformers'
  `AutoTokenizer` adds (Llama 3's adds `<|begin_of_text|>`; OLMo-2's and GPT-2's add nothing,
  though they name a BOS token). `pad_id` is always usable
  (the model's PAD, else EOS, else 0). `eod_id` is the EOS id, the separator between documents
  in pretraining data; it raises if the model has no EOS.
- `model_bytes()` is the whole model as bytes (the sentencepiece proto or the `tokenizer.json`
  text), which is what a checkpoint stores; `save(path)` writes it atomically.
- `load_tokenizer(path)` takes a `.model` file, a `tokenizer.json`, or a directory holding one.
- `train_tokenizer(...)` trains a sentencepiece model with UNK=0, BOS=1, EOS=2, PAD=3, byte
  fallback, identity normalization (so `decode(encode(s)) == s`), and an exact vocabulary size.

The `tokenizers` package is optional and imported only when a `tokenizer.json` is loaded.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from tessera.core.files import atomic_file

PathLike = str | os.PathLike[str]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # read as one JSON object per line
# The ids `train_tokenizer` assigns; Llama-family sentencepiece models use the same layout.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class Tokenizer:
    """Text <-> token ids. Subclasses wrap one backend; the module docstring has the contract."""

    kind: str  # "sentencepiece" or "huggingface"
    filename: str  # the file name used when saved into a directory
    # Set by each subclass's constructor; None where the model has no such token.
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    _pad: int | None

    @property
    def pad_token_id(self) -> int | None:
        """The id of the tokenizer's own PAD token; None when it has none (`pad_id` falls back)."""
        return self._pad

    @property
    def pad_id(self) -> int:
        """The PAD id, else EOS, else 0: padding positions are masked out, any valid id works."""
        for candidate in (self._pad, self.eos_id):
            if candidate is not None:
                return candidate
        return 0

    @property
    def eod_id(self) -> int:
        """End of document, placed between documents in pretraining data: the EOS id."""
        if self.eos_id is None:
            raise ValueError(f"this {self.kind} tokenizer has no EOS token, so it has no EOD id")
        return self.eos_id

    @property
    def adds_bos(self) -> bool:
        """Whether a text prompt starts with BOS (see the module docstring)."""
        return self.bos_id is not None

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS prepended / EOS appended only when asked."""
        ids = self._encode_plain(text)
        if bos:
            if self.bos_id is None:
                raise ValueError(f"this {self.kind} tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eod_id)
        return ids

    def _decode_checked(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's `[start, end)` character span in `text` (what a chat
        template's assistant spans are mapped through to tokens)."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`. Raises ValueError for an id outside `[0, vocab_size)`."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if i < 0 or i >= self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode_checked(ids)

    def model_bytes(self) -> bytes:
        """The serialized model, enough to rebuild this tokenizer with `tokenizer_from_bytes`."""
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as the model spells it (`</s>`, `▁is`, `Ġis`),
        e.g. to name special tokens; not its decoded text."""
        raise NotImplementedError

    def save(self, path: PathLike) -> Path:
        """Write the model to `path` (or to `path/self.filename` if `path` is a directory).

        The write is atomic (temporary file, then rename). Returns the file written.
        """
        target = Path(path)
        if target.is_dir():
            target = target / self.filename
        _write_atomic(target, self.model_bytes())
        return target

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` (BPE or unigram)."""

    kind = "sentencepiece"
    filename = "tokenizer.model"

    def __init__(self, model_proto: bytes) -> None:
        self._proto = model_proto
        self._sp = sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = sp.get_piece_size()
        # sentencepiece reports a disabled special token as -1
        self.bos_id, self.eos_id, self._pad = (
            None if i < 0 else i for i in (sp.bos_id(), sp.eos_id(), sp.pad_id())
        )

    def _encode_plain(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def _decode_checked(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # The serialized SentencePieceText holds each piece's id and byte span in the input;
        # read it by hand (the protobuf package is not a dependency).
        ids, spans = [], []
        for number, value in _proto_fields(self._sp.encode(text, out_type="serialized_proto")):
            if number == 2:  # a piece: id = field 2, begin = 4, end = 5 (byte offsets)
                piece = dict(_proto_fields(value))
                ids.append(piece.get(2, 0))
                spans.append((piece.get(4, 0), piece.get(5, 0)))
        char_at = [0] * (len(text.encode("utf-8")) + 1)
        position = 0
        for index, char in enumerate(text):
            width = len(char.encode("utf-8"))
            char_at[position: position + width] = [index] * width
            position += width
        char_at[position] = len(text)
        out = [(char_at[begin], char_at[end]) for begin, end in spans]
        # The leading byte pieces of a character (and a dummy prefix) span no character:
        # they belong to the character that follows.
        return ids, [(a, min(a + 1, len(text))) if a == b else (a, b) for a, b in out]

    def model_bytes(self) -> bytes:
        return self._proto

    def token_text(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def __reduce__(self) -> tuple[Any, ...]:
        return (SentencePieceTokenizer, (self._proto,))  # picklable for worker processes


# Special-token spellings tried, in order, when a tokenizer.json comes without a config naming them.
_HF_SPECIALS: dict[str, tuple[str, ...]] = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, for models that ship no sentencepiece model.

    Special tokens come from a `tokenizer_config.json` next to the file when there is one
    (`bos_token`, `eos_token`, `pad_token`), else from common spellings such as `</s>`.
    """

    kind = "huggingface"
    filename = "tokenizer.json"

    def __init__(self, json_text: str, config: dict[str, Any] | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _RawTokenizer
        except ImportError as exc:
            raise ImportError(
                "loading a tokenizer.json needs the `tokenizers` package: "
                "pip install tokenizers (or pip install 'tessera[hf]')"
            ) from exc
        self._json, self._config = json_text, config
        self._tok = _RawTokenizer.from_str(json_text)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self._pad = (
            self._find_special(name, (config or {}).get(f"{name}_token")) for name in _HF_SPECIALS
        )
        with_specials = self._tok.encode("a", add_special_tokens=True).ids
        self._adds_bos = self.bos_id is not None and with_specials[:1] == [self.bos_id]

    @property
    def adds_bos(self) -> bool:
        return self._adds_bos

    def _find_special(self, name: str, configured: Any) -> int | None:
        if isinstance(configured, dict):  # {"content": "</s>", "lstrip": false, ...}
            configured = configured.get("content")
        candidates = (configured,) if isinstance(configured, str) else _HF_SPECIALS[name]
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def _encode_plain(self, text: str) -> list[int]:
        # add_special_tokens=False: a post-processor would otherwise add BOS behind our back.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _decode_checked(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    def model_bytes(self) -> bytes:
        return self._json.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (HFTokenizer, (self._json, self._config))


def _proto_fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """`(field number, value)` of a serialized protobuf message: varints as ints,
    length-delimited fields as bytes (the two wire types a SentencePieceText uses)."""

    def varint(at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            byte = data[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if byte < 0x80:
                return value, at

    at = 0
    while at < len(data):
        key, at = varint(at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = varint(at)
        elif wire == 2:
            size, at = varint(at)
            value, at = data[at: at + size], at + size
        elif wire == 5:  # fixed32 (a float score)
            value, at = data[at: at + 4], at + 4
        elif wire == 1:  # fixed64
            value, at = data[at: at + 8], at + 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield number, value


def tokenizer_from_bytes(data: bytes, kind: str = "sentencepiece") -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.model_bytes()` (e.g. as stored in a checkpoint)."""
    if kind == SentencePieceTokenizer.kind:
        return SentencePieceTokenizer(data)
    if kind == HFTokenizer.kind:
        return HFTokenizer(data.decode("utf-8"))
    raise ValueError(f"unknown tokenizer kind {kind!r}: expected 'sentencepiece' or 'huggingface'")


def _resolve_file(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer not found: {path} (give a sentencepiece .model, a tokenizer.json, "
            "or a directory holding one; `tessera tokenizer train` makes a .model)"
        )
    if not path.is_dir():
        return path
    candidates = [path / "tokenizer.model", *sorted(path.glob("*.model")), path / "tokenizer.json"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no tokenizer.model, *.model or tokenizer.json in directory {path}")


def load_tokenizer(path: PathLike) -> Tokenizer:
    """Load a sentencepiece `.model`, a Hugging Face `.json`, or the tokenizer in a directory."""
    file = _resolve_file(Path(path))
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read tokenizer file {file}: {exc}") from exc
    if file.suffix == ".json":
        config_file = file.parent / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else None
            return HFTokenizer(data.decode("utf-8"), config)
        except ImportError:
            raise
        except Exception as exc:  # the Rust side raises its own exception type
            raise ValueError(f"{file} is not a valid Hugging Face tokenizer.json: {exc}") from exc
    try:
        return SentencePieceTokenizer(data)
    except RuntimeError as exc:
        raise ValueError(
            f"{file} is not a valid sentencepiece model ({exc}); expected a .model file written "
            "by sentencepiece or `tessera tokenizer train`, or a tokenizer.json"
        ) from exc


def _write_atomic(target: Path, data: bytes) -> None:
    with atomic_file(target) as tmp:
        tmp.write_bytes(data)


def _lines(input_files: Sequence[PathLike], texts: Iterable[str] | None, json_key: str) -> Iterator[str]:
    """Non-empty lines of the files, then of `texts`.

    sentencepiece treats each item as one sentence and drops sentences longer than
    `max_sentence_length`, so documents are fed line by line rather than whole.
    """
    for name in input_files:
        path = Path(name)
        opener = gzip.open if path.suffix == ".gz" else open
        jsonl = (path.with_suffix("") if path.suffix == ".gz" else path).suffix in JSONL_SUFFIXES
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not jsonl:
                    if line.strip():
                        yield line.rstrip("\n")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # `tessera tokenizer train` counts these; here they are just skipped
                text = record.get(json_key) if isinstance(record, dict) else None
                if isinstance(text, str):
                    yield from (s for s in text.splitlines() if s.strip())
    for text in texts or ():
        yield from (s for s in text.splitlines() if s.strip())


def train_tokenizer(
    input_files: Sequence[PathLike],
    vocab_size: int,
    output: PathLike,
    model_type: str = "bpe",
    *,
    texts: Iterable[str] | None = None,
    json_key: str = "text",
    input_sentence_size: int = 2_000_000,
    character_coverage: float = 0.9995,
    num_threads: int | None = None,
) -> SentencePieceTokenizer:
    """Train a sentencepiece tokenizer and write it to `output` (a `.model` file).

    Args:
        input_files: text files, one sentence per line, or JSON-lines files (`.jsonl`, `.json`,
            `.ndjson`) whose `json_key` field holds the text; `.gz` accepted. Malformed JSON
            lines are skipped.
        vocab_size: the exact vocabulary size, including 4 specials and 256 byte pieces.
        output: where the model goes; written atomically.
        model_type: "bpe" or "unigram".
        texts: more text (e.g. documents), streamed after `input_files`.
        json_key: the text field of JSON-lines inputs.
        input_sentence_size: sentencepiece samples at most this many lines (reservoir sampling
            over a shuffled stream), which bounds the trainer's memory on large corpora.
        character_coverage: the share of characters that get their own piece; the rest fall
            back to bytes.
        num_threads: trainer threads (default: all CPUs).

    Raises:
        ValueError: a bad argument, no text at all, or a corpus too small for `vocab_size`.
        OSError: an input file is missing or unreadable.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    minimum = 4 + 256 + 1  # specials + byte-fallback pieces + at least one learned piece
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (4 specials + 256 bytes + 1)")
    for name in input_files:
        if not Path(name).is_file():
            raise FileNotFoundError(f"tokenizer training input not found: {name}")
    lines = _lines(input_files, texts, json_key)
    try:
        first = next(lines)
    except StopIteration:
        raise ValueError("no text to train the tokenizer on: the inputs are empty") from None
    failures: list[BaseException] = []

    def stream() -> Iterator[str]:
        # sentencepiece turns an error raised in here into a RuntimeError; keep the original.
        try:
            yield first
            yield from lines
        except Exception as exc:
            failures.append(exc)
            raise

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=stream(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            byte_fallback=True,  # no <unk> for unseen characters: they become UTF-8 bytes
            # identity + keeping whitespace makes decode(encode(s)) == s
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            hard_vocab_limit=True,  # the vocabulary size is exact, or training fails
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            character_coverage=character_coverage,
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,  # sentencepiece logs every step to stderr otherwise
        )
    except RuntimeError as exc:
        if failures:
            raise failures[0] from None
        limit = re.search(r"value <= (\d+)", str(exc))
        if limit:
            raise ValueError(
                f"the corpus is too small for vocab_size={vocab_size}: it supports at most "
                f"{limit.group(1)} pieces; use a smaller --vocab-size or more text"
            ) from exc
        chars = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(exc))
        if chars:
            raise ValueError(
                f"vocab_size={vocab_size} cannot hold the specials, the 256 byte pieces and the "
                f"corpus's characters ({chars.group(1)} in all); raise --vocab-size"
            ) from exc
        raise ValueError(f"sentencepiece training failed: {exc}") from exc
    tokenizer = SentencePieceTokenizer(model.getvalue())
    tokenizer.save(output)
    return tokenizer
