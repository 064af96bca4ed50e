"""Hugging Face model directories in and out: `open_hf_dir`, `import_hf`, `export_hf`.

Reading (`open_hf_dir`): `config.json` plus the weights as transformers writes them: a single
`model.safetensors`, sharded safetensors behind `model.safetensors.index.json`, or (for old
checkpoints) `pytorch_model.bin` / its index, loaded only with `torch.load(weights_only=True)`
and memory-mapped. Tensors are read lazily, one `read(name)` at a time. The tokenizer is
`tokenizer.model` (sentencepiece) when present, else `tokenizer.json`.

`import_hf` writes a Tessera checkpoint (layout tp1/pp1) exactly as `core.checkpoint` does: one
`model-tp00-pp00.safetensors`, the manifest with its `weight_map`, and the tokenizer (with the
HF `tokenizer_config.json` next to it when there is one, where `core.tokenizer` looks for the
special tokens) and the HF `generation_config.json` when there is one (eos ids and default
sampling `tessera serve` uses, `core.generation_defaults`). Tensors stream from the HF files
into the output file one at a time, so peak memory is about one tensor. The HF special-token
ids go into the manifest's `extra["hf"]`.

`export_hf` writes `config.json`, `generation_config.json` (the imported one when the
checkpoint kept it), `model.safetensors` (or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` past `shard_size_bytes`) and
the tokenizer, so `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load the directory.
A sentencepiece BPE tokenizer also gets a `tokenizer.json` built here from the `.model` file:
transformers v5 can only convert a `.model` itself with `protobuf` installed, and the generated
file encodes exactly as sentencepiece does (dummy prefix, byte fallback, no normalization).

FP8 (`converters.hf_fp8`): `export_hf(..., fp8=Fp8Export("block" | "tensor"))` writes the linear
layers in e4m3 with the scales and `quantization_config` vLLM, SGLang and transformers load;
`import_hf` reads such directories, dequantizing as those loaders do.

Both directions are atomic (temporary sibling directory, then one rename) and refuse an
existing output unless `overwrite=True`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from tessera.converters.hf_fp8 import (
    Fp8Export,
    check_fp8_exportable,
    dequantizing_reader,
    export_fp8_tensors,
    quantization_config,
)
from tessera.converters.hf_mapping import (
    ConversionError,
    Read,
    config_for_weights,
    config_from_hf,
    config_to_hf,
    export_tensors,
    import_tensors,
)
from tessera.converters.safetensors_stream import SafetensorsWriter
from tessera.core.checkpoint import (
    CheckpointReader,
    Manifest,
    atomic_directory,
    build_manifest,
    dtype_from_name,
    dtype_name,
    shard_file_name,
    write_manifest,
)
from tessera.core.config import Layout
from tessera.core.generation_defaults import GENERATION_CONFIG, read_generation_defaults
from tessera.core.parallel.sharding import global_param_shapes
from tessera.core.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes per exported file, transformers' own default ("5GB")
_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
_SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HFDir(NamedTuple):
    """An opened Hugging Face model directory; `read(name)` loads one tensor on demand."""

    config: dict[str, Any]
    read: Read
    names: set[str]
    tokenizer: Path | None


def _lazy_files(path: Path, weight_map: dict[str, str], bin_files: bool) -> Read:
    """`read(name)` over the files of `weight_map`, each opened on first use."""
    opened: dict[str, Any] = {}

    def read(name: str) -> torch.Tensor:
        if name not in weight_map:
            raise ConversionError(f"{path}: no tensor named {name}")
        file = weight_map[name]
        if file not in opened:
            if not (path / file).is_file():
                raise ConversionError(f"{path}: {file} is missing (listed in the index)")
            if bin_files:  # weights_only: tensors and plain containers, never code
                opened[file] = torch.load(path / file, map_location="cpu", weights_only=True,
                                          mmap=True)
            else:
                opened[file] = safe_open(str(path / file), framework="pt")
        handle = opened[file]
        return handle[name] if bin_files else handle.get_tensor(name)

    return read


def _weight_map(path: Path, file: str, bin_files: bool) -> dict[str, str]:
    if file.endswith(".index.json"):
        return dict(json.loads((path / file).read_text())["weight_map"])
    if bin_files:
        names = torch.load(path / file, map_location="cpu", weights_only=True, mmap=True)
    else:
        with safe_open(str(path / file), framework="pt") as handle:
            names = handle.keys()
    return {name: file for name in names}


_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors",
                 "pytorch_model.bin.index.json", "pytorch_model.bin")


def open_hf_dir(path: str | Path) -> HFDir:
    """Open a Hugging Face model directory for lazy reading.

    Raises:
        ConversionError: no config.json, an unsupported architecture, or no weights file.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConversionError(f"{path} is not a Hugging Face model directory: config.json is "
                              "missing")
    config = json.loads((path / "config.json").read_text())
    config_from_hf(config)  # fail on an unsupported architecture before touching the weights
    file = next((f for f in _WEIGHT_FILES if (path / f).is_file()), None)
    if file is None:
        raise ConversionError(f"{path} has no weights: none of {', '.join(_WEIGHT_FILES)} "
                              "exists (for other formats, re-save with save_pretrained)")
    bin_files = file.startswith("pytorch_model")
    weight_map = _weight_map(path, file, bin_files)
    tokenizer = next((path / t for t in ("tokenizer.model", "tokenizer.json")
                      if (path / t).is_file()), None)
    return HFDir(config, _lazy_files(path, weight_map, bin_files), set(weight_map), tokenizer)


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return dtype_from_name(dtype) if isinstance(dtype, str) else dtype


def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | str | None = None,
              overwrite: bool = False) -> Path:
    """Convert the HF model at `hf_dir` into a Tessera checkpoint at `out_dir`; return it.

    `dtype` (e.g. "bf16") casts every tensor; by default the HF tensors keep their dtype. An
    FP8 directory (`converters.hf_fp8`: block, per tensor or compressed-tensors) is dequantized
    to fp32 as its loaders do, then cast to `dtype`, by default the embeddings' dtype (the
    export's high precision), so the checkpoint is a plain one.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    src = open_hf_dir(hf_dir)
    config = dataclasses.replace(config_from_hf(src.config), name=hf_dir.resolve().name)
    config = config_for_weights(config, src.names)
    shapes = global_param_shapes(config)
    read, names = dequantizing_reader(src.config, src.read, src.names)
    tensors = import_tensors(config, read, names)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        first_name, first = next(tensors)  # its dtype is the checkpoint's unless one is given
        target = _parse_dtype(dtype) or first.dtype
        file = shard_file_name(0, 0)
        entries = [(name, target, shape) for name, shape in shapes.items()]
        with SafetensorsWriter(tmp / file, entries, metadata=_METADATA) as writer:
            writer.write(first_name, first.to(target))
            del first
            for name, tensor in tensors:
                writer.write(name, tensor.to(target))
        tok_name = None
        if src.tokenizer is not None:
            tok_name = src.tokenizer.name
            shutil.copyfile(src.tokenizer, tmp / tok_name)
            if (hf_dir / "tokenizer_config.json").is_file():
                shutil.copyfile(hf_dir / "tokenizer_config.json", tmp / "tokenizer_config.json")
            _copy_chat_template(hf_dir, tmp)
        if (hf_dir / GENERATION_CONFIG).is_file():  # eos ids and default sampling, for serving
            read_generation_defaults(hf_dir)  # a malformed file fails the import, not the server
            shutil.copyfile(hf_dir / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        hf_extra = {"model_type": src.config["model_type"],
                    **{k: src.config.get(k) for k in _SPECIAL_KEYS}}
        write_manifest(tmp, build_manifest(config, Layout(), {n: [file] for n in shapes},
                                           dtype=target, tokenizer=tok_name,
                                           extra={"hf": hf_extra}))
    return out_dir


_Entry = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor of a file: name, dtype, shape


def _plan_shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive groups of entries of at most `limit` bytes (a larger tensor stands alone)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for name, dtype, shape in entries:
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, shape))
        size += nbytes
    return shards


def _write_weights(tmp: Path, stream: Iterator[tuple[str, torch.Tensor]],
                   plan: list[list[_Entry]]) -> None:
    n = len(plan)
    files = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for file, shard in zip(files, plan, strict=True):
        with SafetensorsWriter(tmp / file, shard, metadata=_METADATA) as writer:
            for expected, dtype, _ in shard:  # the stream yields in plan order
                name, tensor = next(stream)
                assert name == expected, (name, expected)
                total += writer.write(name, tensor.to(dtype))
                weight_map[name] = file
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _special_ids(manifest: Manifest, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """HF special-token ids: those recorded at import, else the tokenizer's own (PAD only when
    it has a PAD token: `pad_token_id` stays null rather than naming EOS)."""
    ids = {k: v for k, v in manifest.extra.get("hf", {}).items() if k in _SPECIAL_KEYS}
    if not ids and tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
               "pad_token_id": tokenizer.pad_token_id}
    return ids


def export_hf(ckpt_dir: str | Path, out_dir: str | Path,
              shard_size_bytes: int = DEFAULT_SHARD_SIZE, overwrite: bool = False,
              dtype: torch.dtype | str | None = None, fp8: Fp8Export | None = None) -> Path:
    """Write the Tessera checkpoint at `ckpt_dir` as a Hugging Face model directory.

    Any saved layout works (tensors are read globally, FP8 ones dequantized); `dtype` casts.
    `fp8` writes the linear layers in FP8 with the scales and `quantization_config` vLLM and
    transformers load (`converters.hf_fp8`); everything else is in `dtype`.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    reader = CheckpointReader(ckpt_dir)
    manifest, config = reader.manifest, reader.manifest.model
    target = _parse_dtype(dtype) or dtype_from_name(manifest.dtype)
    tokenizer = load_tokenizer(ckpt_dir / manifest.tokenizer) if manifest.tokenizer else None
    ids = _special_ids(manifest, tokenizer)
    hf_config = config_to_hf(config, dtype=dtype_name(target), **ids)  # fails if unexportable
    if fp8 is not None:
        check_fp8_exportable(config, fp8)
        hf_config["quantization_config"] = quantization_config(config, fp8)

    def tensors(read: Read) -> Iterator[tuple[str, torch.Tensor]]:
        if fp8 is not None:
            return export_fp8_tensors(config, read, fp8, target)
        return ((n, t.to(target)) for n, t in export_tensors(config, read))

    shapes = global_param_shapes(config)
    # The same mapping over meta tensors gives every HF name and shape without reading data.
    meta = tensors(lambda n: torch.empty(shapes[n], device="meta"))
    plan = _plan_shards([(n, t.dtype, tuple(t.shape)) for n, t in meta], shard_size_bytes)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        _write_weights(tmp, tensors(reader.global_tensor), plan)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if (ckpt_dir / GENERATION_CONFIG).is_file():  # imported from HF: keep it as it was
            shutil.copyfile(ckpt_dir / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        else:
            generation = {"_from_model_config": True,
                          **{k: v for k, v in ids.items() if v is not None}}
            (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        if manifest.tokenizer:
            _export_tokenizer(ckpt_dir, manifest.tokenizer, tokenizer,
                              config.max_position_embeddings, tmp)
    return out_dir


# ------------------------------------------------------------------------------- tokenizer

# Where transformers keeps a chat template outside tokenizer_config.json (v4.43+ saves it so).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _copy_chat_template(src_dir: Path, dst_dir: Path) -> None:
    for name in CHAT_TEMPLATE_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)


def _token_texts(path: Path, ids: dict[str, int | None]) -> dict[str, str]:
    """The text of each special token id (sentencepiece piece or tokenizer.json token)."""
    if path.suffix == ".model":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        to_text = sp.id_to_piece
    else:
        from tokenizers import Tokenizer

        to_text = Tokenizer.from_file(str(path)).id_to_token
    return {k: to_text(i) for k, i in ids.items() if i is not None}


def sentencepiece_to_tokenizer_json(model_file: str | Path) -> str | None:
    """A `tokenizer.json` equivalent to a sentencepiece BPE model, or None for other models.

    BPE merges are not stored in a `.model`: every split of a piece into two pieces of the
    vocabulary is a merge, ranked by the piece's score (sentencepiece merges the best-scoring
    pair first). Spaces become `▁` and one `▁` is prepended, as sentencepiece's dummy prefix
    does; characters outside the vocabulary fall back to byte pieces `<0x..>`.
    """
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    normal = [i for i in range(n) if not (i in special or sp.is_byte(i) or sp.is_unused(i))]
    # sentencepiece BPE scores are minus the merge rank, whole numbers; unigram ones are
    # log-probabilities. Unigram or NFKC-normalizing models are left to transformers' own
    # (protobuf-based) conversion.
    if any(sp.get_score(i) != int(sp.get_score(i)) for i in normal):
        return None
    if sp.normalize("\uff21").lstrip("▁") != "\uff21":  # a fullwidth A survives identity only
        return None
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    score = {sp.id_to_piece(i): sp.get_score(i) for i in normal}
    merges = sorted(((piece, piece[:k], piece[k:]) for piece in score
                     for k in range(1, len(piece))
                     if piece[:k] in vocab and piece[k:] in vocab),
                    key=lambda m: (-score[m[0]], vocab[m[1]], vocab[m[2]]))
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = Tokenizer(BPE(vocab, [(a, b) for _, a, b in merges], unk_token=unk, fuse_unk=True,
                        byte_fallback=True))
    dummy_prefix = sp.encode("a", out_type=str)[0].startswith("▁")
    steps = [normalizers.Prepend("▁")] if dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if dummy_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), *tail])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                            for i in special])
    return tok.to_str()


def _with_bos(tokenizer_json: str, bos_id: int | None) -> str:
    """The tokenizer.json adding BOS when special tokens are asked for (transformers' default,
    which `add_bos_token` alone does not give the generic tokenizer class)."""
    if bos_id is None:
        return tokenizer_json
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_str(tokenizer_json)
    bos = tok.id_to_token(bos_id)
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                            special_tokens=[(bos, bos_id)])
    return tok.to_str()


def _export_tokenizer(ckpt_dir: Path, name: str, tokenizer: Tokenizer, max_length: int,
                      tmp: Path) -> None:
    src = ckpt_dir / name
    shutil.copyfile(src, tmp / name)
    _copy_chat_template(ckpt_dir, tmp)
    if name.endswith(".model"):
        text = sentencepiece_to_tokenizer_json(src)
        if text is not None:
            (tmp / "tokenizer.json").write_text(_with_bos(text, tokenizer.bos_id))
    if (ckpt_dir / "tokenizer_config.json").is_file():  # imported from HF: keep it as it was
        shutil.copyfile(ckpt_dir / "tokenizer_config.json", tmp / "tokenizer_config.json")
        return
    if name.endswith(".json"):
        (tmp / name).write_text(_with_bos(src.read_text(), tokenizer.bos_id))
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
           "pad_token": tokenizer.pad_token_id}
    if name.endswith(".model"):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(src))
        ids["unk_token"] = sp.unk_id() if sp.unk_id() >= 0 else None
    # The generic class loads tokenizer.json verbatim (v4 and v5); v5's LlamaTokenizer would
    # rebuild the pipeline and drop the dummy prefix before leading spaces.
    # add_bos_token as `tessera serve` tokenizes a text prompt (BOS first when there is one),
    # so HF users and lm-eval see the sequences the server runs.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "add_bos_token": tokenizer.bos_id is not None, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, **_token_texts(src, ids)}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
