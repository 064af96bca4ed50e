"""Checkpoint directories: a JSON manifest, the tokenizer, and safetensors weight files.

Layout of `CKPT/` (see docs/architecture.md, "Checkpoint format"):
- `manifest.json`: format name and version, model config, the layout the weights were saved
  under (the whole `Layout`: tp, pp, virtual stages, stage placement, dp, sequence parallel),
  dtype, FP8 description if any, step, tokenizer file, and `weight_map`: for each global
  parameter name, the files holding its tensor-parallel shards in tp-rank order (a replicated
  tensor: one file, or one full copy per tp rank in a converted checkpoint, so that each rank
  reads only its own file);
- `tokenizer.model` (or `tokenizer.json`), when the model has one;
- `model-tp{t}-pp{p}.safetensors`: the tensors of tp rank t, pipeline rank p, under their global
  names. Rank (t, p) of the same layout reads only its own file; any other layout reads the shards
  it needs and re-slices them with `sharding`, so every checkpoint loads under every layout,
  bit-exactly. Under expert parallelism the expert banks go to
  `experts-ep{e}-etp{t}-pp{p}.safetensors` instead (`core.expert_checkpoint`). Under kv-head
  replication (tp > num_kv_heads) each file holds its rank's
  `sharding.stored_shard`: a kv head is stored once, by the first rank of its replica group, and
  the other ranks of the group read it from there. An FP8 weight (see `core.fp8`) keeps its fp32
  scale `NAME.scale` next to each shard, in the same file. Files are opened lazily
  (memory-mapped); no pickle anywhere;
- `digests-rank{r}.json`: the sha256 of every file rank r wrote, taken as it was written
  (`core.checkpoint_digests`); `load_checkpoint`, training resume and `tessera inspect --verify`
  check them (`verify_files`). Checkpoints without them (older ones, converters') still load.

Every writer (`save_checkpoint`, the converters) builds its manifest with `build_manifest` and
writes it with `write_manifest`. Format version 2 records the whole layout; version 1 (before
`Layout`) recorded tp, pp and virtual_stages only, and still loads, as the looped placement.

A save is three parts: `prepare_checkpoint` (collective: the temporary directory, this rank's
tensors on the host, the manifest), `CheckpointWrite.write` (no collective: files and digests,
so it may run on a background thread) and `publish_checkpoint` (collective: the rename).

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place
last, so a crash mid-write leaves any earlier checkpoint untouched (`atomic_directory`,
`publish_directory`, used by every writer of a directory). A run's numbered checkpoints and its
`latest` pointer are a `CheckpointSeries`. Files are published with the mode a plain `open`
gives (0644, directories 0755, under the usual umask; `core.files`), whatever the temp-file API
chose, so a non-root container can read a mounted checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tessera.core.checkpoint_digests import DigestWriter, damaged_files
from tessera.core.config import ConfigError, Layout, ModelConfig
from tessera.core.expert_checkpoint import (
    expert_sharded,
    expert_tensors,
    read_expert_shard,
    stored_in_pieces,
)
from tessera.core.files import atomic_file, dir_mode, file_mode
from tessera.core.host_copy import host_copy
from tessera.core.parallel.sharding import (
    global_param_shapes,
    shard_spec,
    shard_tensor,
    stored_shard,
    stored_sources,
    unshard_tensors,
)

FORMAT = "tessera-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: the layout holds only tp, pp and virtual_stages (looped)
MANIFEST = "manifest.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and the problem."""


def dtype_from_name(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
    name = aliases.get(name, name)
    if name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Manifest:
    """The parsed `manifest.json` of a checkpoint (build new ones with `build_manifest`)."""

    model: ModelConfig
    layout: Layout
    dtype: str = "float32"
    step: int = 0
    tokenizer: str | None = None
    fp8: dict[str, Any] | None = None  # {"format": "e4m3", "granularity": "tensor" | "channel"}
    weight_map: dict[str, list[str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. training metadata

    def to_json(self) -> str:
        body = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "model": self.model.to_dict(), "layout": self.layout.to_dict(),
                "dtype": self.dtype, "step": self.step, "tokenizer": self.tokenizer,
                "fp8": self.fp8, "extra": self.extra, "weight_map": self.weight_map}
        return json.dumps(body, indent=2) + "\n"


def build_manifest(
    model: ModelConfig,
    layout: Layout,
    weight_map: Mapping[str, Sequence[str]],
    *,
    dtype: torch.dtype | str,
    step: int = 0,
    tokenizer: str | None = None,
    fp8: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest of a checkpoint of `model` saved under `layout`: the one way every writer
    makes it.

    `weight_map` gives, for each global parameter name, the files holding its tp shards in
    tp-rank order (see the module docstring); it must name every global parameter of `model`
    and nothing else, and is stored in the model's parameter order. `tokenizer` is the file
    name inside the checkpoint. Raises `CheckpointError` for a weight map that does not fit
    the model, `ConfigError` for a layout that cannot hold it.
    """
    order = list(global_param_shapes(model))
    missing = [n for n in order if n not in weight_map]
    unknown = sorted(set(weight_map) - set(order))
    if missing or unknown:
        raise CheckpointError(f"the weight map does not fit the model: missing {missing[:5]}, "
                              f"unknown {unknown[:5]}")
    layout.validate(model)
    return Manifest(model=model, layout=layout,
                    dtype=dtype if isinstance(dtype, str) else dtype_name(dtype), step=step,
                    tokenizer=tokenizer, fp8=fp8,
                    weight_map={n: list(weight_map[n]) for n in order}, extra=dict(extra or {}))


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write `manifest` as `directory/manifest.json` (inside a checkpoint being written)."""
    file = Path(directory) / MANIFEST
    file.write_text(manifest.to_json())
    return file


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and validate `path/manifest.json` (format version 1 or 2), with an error that
    says what is wrong."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        hint = " (it looks like a Hugging Face model: use `tessera convert --from hf`)" if (
            Path(path) / "config.json").is_file() else ""
        raise CheckpointError(f"{path} is not a Tessera checkpoint: {MANIFEST} is missing{hint}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format is {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{file}: format version {version} is not supported by this Tessera (reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}); use the Tessera release that "
            "wrote it or convert it with that release")
    try:
        layout = Layout.from_dict(data["layout"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{file}: the layout {data['layout']} cannot be read ({exc})") from exc
    return Manifest(model=ModelConfig.from_dict(data["model"]), layout=layout,
                    dtype=data.get("dtype", "float32"), step=data.get("step", 0),
                    tokenizer=data.get("tokenizer"), fp8=data.get("fp8"),
                    weight_map=data["weight_map"], extra=data.get("extra", {}))


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


class CheckpointReader:
    """Lazy access to a checkpoint's tensors: global (unsharded) or one layout's shard."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = read_manifest(path)
        self._files: dict[str, Any] = {}
        expected = set(global_param_shapes(self.manifest.model))
        missing = expected - set(self.manifest.weight_map)
        if missing:
            raise CheckpointError(f"{self.path}: manifest lacks tensors {sorted(missing)[:5]}...")

    def _open(self, file: str):
        if file not in self._files:
            full = self.path / file
            if not full.is_file():
                raise CheckpointError(f"{full} is missing; the checkpoint is incomplete")
            try:
                self._files[file] = safe_open(str(full), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{full} is not a readable safetensors file ({exc}); it "
                                      "may be truncated: re-copy or re-convert it") from exc
        return self._files[file]

    def _get(self, file: str, key: str) -> torch.Tensor:
        handle = self._open(file)
        try:
            return handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{self.path / file}: cannot read tensor {key!r} ({exc})") from exc

    def names(self) -> list[str]:
        return list(self.manifest.weight_map)

    def raw_shards(self, name: str) -> list[torch.Tensor]:
        """The stored shards of `name` as saved (fp8 ones still quantized)."""
        return [self._get(f, name) for f in self.manifest.weight_map[name]]

    def global_tensor(self, name: str) -> torch.Tensor:
        """The unsharded tensor `name`, dequantized to the checkpoint's dtype if stored as FP8."""
        files = self.manifest.weight_map[name]
        if shard_spec(name, self.manifest.model).dim is None and not stored_in_pieces(name,
                                                                                     files):
            files = files[:1]  # replicated: any copy is the whole tensor
        shards = [self._dequantized(f, name) for f in files]
        return unshard_tensors(name, shards, self.manifest.model)

    def _dequantized(self, file: str, name: str) -> torch.Tensor:
        t = self._get(file, name)
        if self.manifest.fp8 and t.dtype == torch.float8_e4m3fn:
            from tessera.core.fp8 import dequantize

            return dequantize(t, self._get(file, name + ".scale"), dtype_from_name(
                self.manifest.dtype))
        return t

    def shard(self, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
        """The tensor `name` for tp rank `tp_rank` of `tp_size`, read from as few files as can be."""
        files, config = self.manifest.weight_map[name], self.manifest.model
        if len(files) == tp_size and tp_size == self.manifest.layout.tp and not (
                stored_in_pieces(name, files)):  # expert pieces: split over ep x etp, not tp
            sources = stored_sources(name, config, tp_rank, tp_size)
            if sources is None:
                return self._dequantized(files[tp_rank], name)
            # A replicated kv head: stored by the first rank of its replica group.
            return torch.cat([self._dequantized(files[src], name).narrow(0, start, rows)
                              for src, start, rows in sources])
        return shard_tensor(name, self.global_tensor(name), self.manifest.model, tp_rank, tp_size)


def stored_parameters(models: list[nn.Module]) -> dict[str, torch.nn.Parameter]:
    """The parameters one rank's file holds, by global name (the model chunks of one rank).

    Replicated tensors are stored once, by tp rank 0. A tied output copy on a separate last
    stage is never stored: the embedding it equals is stored by the first stage.
    """
    g, config = models[0].groups, models[0].config
    out: dict[str, torch.nn.Parameter] = {}
    for model in models:
        for local_name, param in model.named_parameters():
            if local_name.startswith("embedding_hook."):
                continue
            if model.global_name(local_name) != local_name:  # the tied output copy
                continue
            if expert_sharded(local_name, g):  # written by `write_expert_weights`
                continue
            if shard_spec(local_name, config).dim is not None or g.tp_rank == 0:
                out.setdefault(local_name, param)
    return out


def weight_tensors(models: list[nn.Module], *, copy: bool = False
                   ) -> tuple[str, dict[str, torch.Tensor]]:
    """This rank's shard file name and the tensors it holds, on the host (`copy`: as copies
    that later updates of the parameters do not change; see `host_copy`)."""
    g, config = models[0].groups, models[0].config
    # A replicated kv head is stored by the first rank of its replica group only.
    keep = {n: host_copy(stored_shard(n, p.detach(), config, g.tp_rank, g.tp_size), copy)
            for n, p in stored_parameters(models).items()}
    return shard_file_name(g.tp_rank, g.pp_rank), keep


def write_weights(directory: Path, models: list[nn.Module]) -> dict[str, list[str]]:
    """Write this rank's shard file into `directory`; return its part of the weight map."""
    file, keep = weight_tensors(models)
    save_file(keep, str(directory / file), metadata={"format": "pt"})
    return {n: [file] for n in keep}


@dataclass
class CheckpointWrite:
    """One rank's part of a checkpoint being saved: host copies of its tensors (and, on rank 0,
    the tokenizer and the manifest), to be written into the temporary directory `tmp` and then
    published as `final` (`publish_checkpoint`). `write()` runs no collective, so it may run on
    a background thread while the step goes on."""

    tmp: Path
    final: Path
    rank: int
    files: dict[str, tuple[dict[str, torch.Tensor], dict[str, str] | None]] = field(
        default_factory=dict)
    tokenizer: tuple[str, Path] | None = None  # (name inside the checkpoint, source file)
    manifest: Manifest | None = None  # rank 0 only

    def add(self, relative: str, tensors: dict[str, torch.Tensor],
            metadata: dict[str, str] | None = None) -> None:
        self.files[relative] = (tensors, metadata)

    def write(self, between_files: Any = None) -> None:
        """Write every file, recording its sha256 as it is written (`core.checkpoint_digests`);
        the manifest last. `between_files()`, if given, is called after each tensor file."""
        writer = DigestWriter(self.tmp, self.rank)
        for relative in list(self.files):
            tensors, metadata = self.files.pop(relative)  # the host copy is freed once written
            writer.write_tensors(relative, tensors, metadata)
            if between_files is not None:
                between_files()
        if self.tokenizer is not None:
            writer.copy_file(*self.tokenizer)
        writer.finish()
        if self.manifest is not None:
            write_manifest(self.tmp, self.manifest)


def prepare_checkpoint(
    path: str | os.PathLike,
    models: list[nn.Module],
    *,
    step: int = 0,
    tokenizer: str | os.PathLike | None = None,
    extra: dict[str, Any] | None = None,
    copy: bool = False,
) -> CheckpointWrite:
    """Make the temporary directory and take this rank's tensors for a checkpoint of `models`
    at `path` (`copy`: as host copies, see `host_copy`). Collective when torch.distributed is
    initialized; the returned `CheckpointWrite` is written without any."""
    g, distributed = models[0].groups, dist.is_available() and dist.is_initialized()
    path = Path(path)
    token = [uuid.uuid4().hex[:8]]
    if distributed:
        dist.broadcast_object_list(token, src=0)
    rank = dist.get_rank() if distributed else 0
    pending = CheckpointWrite(temp_sibling(path, token[0]), path, rank)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        pending.tmp.mkdir()
    if distributed:
        dist.barrier()
    weight_map: dict[str, list[str]] = {}
    if g.dp_cp_rank == 0:  # cp replicas too
        file, tensors = weight_tensors(models, copy=copy)
        pending.add(file, tensors, {"format": "pt"})
        weight_map = {n: [file] for n in tensors}
    experts = expert_tensors(models, copy=copy)  # expert parallelism only
    if experts is not None:
        file, tensors = experts
        pending.add(file, tensors, {"format": "pt"})
        weight_map.update({n: [file] for n in tensors})
    maps = [weight_map]
    if distributed:
        maps = [None] * dist.get_world_size()
        dist.all_gather_object(maps, weight_map)
    if rank == 0:
        merged = _merge_weight_maps(maps, models[0])
        tok_name = None
        if tokenizer is not None:
            tok_name = "tokenizer.json" if str(tokenizer).endswith(".json") else "tokenizer.model"
            pending.tokenizer = (tok_name, Path(tokenizer))
        # The groups are what the weights were split over; the model's layout adds the rest.
        layout = replace(models[0].layout, tp=g.tp_size, pp=g.pp_size, dp=g.dp_size,
                         cp=g.cp_size)
        dtype = next(models[0].parameters()).dtype
        pending.manifest = build_manifest(models[0].config, layout, merged, dtype=dtype,
                                          step=step, tokenizer=tok_name, extra=extra)
    return pending


def publish_checkpoint(pending: CheckpointWrite) -> Path:
    """Put the written checkpoint in place once every rank has written its part (rank 0
    renames it). Collective when torch.distributed is initialized: every rank calls it after
    its own `pending.write()` has returned."""
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier()
    if pending.rank == 0:
        publish_directory(pending.tmp, pending.final)
    if distributed:
        dist.barrier()
    return pending.final


def save_checkpoint(
    path: str | os.PathLike,
    models: nn.Module | list[nn.Module],
    *,
    step: int = 0,
    tokenizer: str | os.PathLike | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save the model chunks of every rank as one checkpoint at `path`, atomically, with the
    sha256 of every file recorded as it is written.

    Collective when torch.distributed is initialized: every rank calls it with its own chunks;
    data-parallel replicas other than dp rank 0 write no weights.
    """
    models = models if isinstance(models, list) else [models]
    pending = prepare_checkpoint(path, models, step=step, tokenizer=tokenizer, extra=extra)
    pending.write()
    return publish_checkpoint(pending)


def _merge_weight_maps(maps: list[dict[str, list[str]]], model: nn.Module) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for part in maps:
        for name, files in part.items():
            merged.setdefault(name, []).extend(f for f in files if f not in merged.get(name, []))
    order = list(global_param_shapes(model.config))
    return {n: sorted(merged[n]) for n in order if n in merged}


@torch.no_grad()
def load_weights(models: nn.Module | list[nn.Module], path: str | os.PathLike) -> Manifest:
    """Fill the model chunks of this rank from the checkpoint at `path`, whatever its layout."""
    models = models if isinstance(models, list) else [models]
    reader = CheckpointReader(path)
    _check_config(reader.manifest.model, models[0].config, path)
    for model in models:
        g = model.groups
        for local_name, param in model.named_parameters():
            if local_name.startswith("embedding_hook."):
                continue
            name = model.global_name(local_name)
            value = read_expert_shard(reader, name, g) if expert_sharded(name, g) else \
                reader.shard(name, g.tp_rank, g.tp_size)
            if value.shape != param.shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {tuple(value.shape)}, "
                                      f"the model expects {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
    return reader.manifest


def _check_config(saved: ModelConfig, wanted: ModelConfig, path: Any) -> None:
    a, b = saved.to_dict(), wanted.to_dict()
    a.pop("name"), b.pop("name")
    a.pop("dropout"), b.pop("dropout")
    diff = {k: (a[k], b[k]) for k in a if a[k] != b.get(k)}
    if diff:
        raise CheckpointError(f"{path}: the checkpoint's model differs from the one being loaded "
                              f"into: {diff} (saved, wanted)")


_UNVERIFIED_WARNED: set[str] = set()


def verify_files(path: str | os.PathLike, remedy: str) -> None:
    """Check every file of checkpoint `path` against the sha256 recorded when it was written
    (one full read of the checkpoint). Raises `CheckpointError` naming the first damaged or
    missing file and `remedy` (what to do instead). A checkpoint that records no digests
    (written before they were) passes, with a warning printed once per process."""
    path = Path(path)
    problems = damaged_files(path)
    if problems is None:
        if not _UNVERIFIED_WARNED:
            print(f"warning: checkpoint {path} records no file digests (written by an older "
                  "Tessera or a converter); its bytes are not verified", file=sys.stderr,
                  flush=True)
        _UNVERIFIED_WARNED.add(str(path))
        return
    if problems:
        file, problem = problems[0]
        others = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path.name}: {file} is {problem}{others}; {remedy}")


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu", *, verify: bool = True) -> nn.Module:
    """A single-process model with the checkpoint's weights (any saved layout; FP8 dequantized).

    `dtype` defaults to the checkpoint's own dtype (its higher-precision dtype for FP8 ones).
    `verify`: check every file's recorded sha256 first (`verify_files`; one extra read).
    """
    from tessera.core.init import build_model

    manifest = read_manifest(path)
    if verify:
        verify_files(path, "re-copy it from where it came from, or load an earlier checkpoint")
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    dtype = dtype or dtype_from_name(manifest.dtype)
    model = build_model(manifest.model, device=device, dtype=dtype, init=False)
    load_weights(model, path)
    return model.eval()


# ------------------------------------------------------------------ atomic directories, series

def temp_sibling(final: str | os.PathLike, token: str | None = None) -> Path:
    """The hidden temporary sibling `.NAME.tmp-TOKEN` of `final` (same file system, so the
    final rename is atomic). Ranks writing one directory together share one `token`."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{token or uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success `publish_directory` puts it in place.

    On any error the temporary directory is removed and `final` (if it existed) is untouched.
    `overwrite=False` refuses an existing `final` before anything is written.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists; pass --overwrite to replace it")
    tmp = temp_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_directory(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the finished directory `tmp` appear as `final` in one rename.

    Every file below `tmp` is fsynced (its contents are on disk before the rename makes them
    visible) and given the mode a plain `open` / `mkdir` would (`core.files`: 0644 / 0755 under
    the usual umask, whatever mkstemp or safetensors chose). A previous `final` is
    renamed aside first and removed only after the new one is in place, so a crash at any
    moment leaves a complete directory at `final` or a recoverable `.NAME.old-*` sibling.
    """
    tmp, final = Path(tmp), Path(final)
    fmode, dmode = file_mode(), dir_mode()
    for directory, _, files in os.walk(tmp):
        os.chmod(directory, dmode)
        for name in files:
            path = os.path.join(directory, name)
            os.chmod(path, fmode)
            fd = os.open(path, os.O_RDONLY)  # to fsync it; nothing is read
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class CheckpointSeries:
    """The numbered checkpoints of one run: `ROOT/step-NNNNNNNN/` plus the `ROOT/latest` pointer.

    A step directory counts as complete when it holds `marker` (each is published whole by
    `publish_directory`; the marker also rules out a directory damaged by hand). The pointer
    names the newest complete one and is replaced atomically after that one is in place; when it
    is missing or names an incomplete directory, `latest()` falls back to the highest step.
    """

    root: Path
    marker: str = MANIFEST

    POINTER = "latest"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def complete(self) -> list[Path]:
        """Complete step directories, oldest first (by step number, not by name)."""
        found = []
        for path in self.root.glob("step-*"):
            number = path.name.removeprefix("step-")
            if number.isdigit() and (path / self.marker).is_file():
                found.append((int(number), path))
        return [path for _, path in sorted(found)]

    def latest(self, accept: Callable[[Path], bool] | None = None) -> Path | None:
        """The newest complete checkpoint, or None when there is none. With `accept`, the
        newest complete one it accepts (it is asked newest first, and only as far as needed)."""
        pointer = self.root / self.POINTER
        name = pointer.read_text().strip() if pointer.is_file() else ""
        done = self.complete()
        if name and (self.root / name / self.marker).is_file():
            named = self.root / name
            done = [p for p in done if p != named] + [named]  # the pointer's first
        for candidate in reversed(done):
            if accept is None or accept(candidate):
                return candidate
        return None

    def mark_latest(self, path: str | os.PathLike) -> None:
        """Point `latest` at the step directory `path` (a temporary file, then one rename)."""
        with atomic_file(self.root / self.POINTER) as tmp:
            tmp.write_text(Path(path).name + "\n")

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (`keep_last <= 0`: keep
        all) and whatever a crash mid-save left: temporary and replaced step directories, and
        a temporary `latest` pointer from a writer killed between its write and its rename.
        Only the one writer that calls `mark_latest` may call this (it runs after that)."""
        done = self.complete()
        for old in done[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in [*self.root.glob(".step-*.tmp-*"), *self.root.glob(".step-*.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(f".{self.POINTER}.tmp-*"):
            stale.unlink(missing_ok=True)
