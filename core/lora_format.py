"""LoRA adapters on disk: what `tessera tune --method lora` writes, the PEFT converters read and
write, and the server loads.

An adapter directory holds
- `adapter.safetensors`: per adapted linear layer MODULE (a checkpoint name less `.weight`, e.g.
  `layers.0.attention.wqkv`, `layers.0.attention.wo`, `layers.0.feed_forward.w1`,
  `layers.0.feed_forward.w2`), `MODULE.lora_A.weight` of shape `(r_m, in_features)` and
  `MODULE.lora_B.weight` of shape `(out_features, r_m)`, fp32, *global* (unsharded) shapes. B's
  rows are the base weight's rows as the checkpoint stores them (fused QKV as `[q; k; v]`,
  SwiGLU's fused gate/up as the checkpoint has them), so the sharding rule that splits a base
  weight splits B (column-parallel) or A (row-parallel) the same way.
- `adapter.json` (written last, so a directory with it is complete): format and version, `rank`,
  `alpha`, `dropout`, the `targets` patterns it was made with, the adapted `modules`, the base
  checkpoint's path and fingerprint (`core.fingerprint`), and the sha256 of the weights.

The product is `y = base(x) + (alpha / rank) * B (A dropout(x))` with the adapter's one `rank`
and `alpha`; a module's own rank `r_m` may differ from `rank` (an imported PEFT adapter puts
three rank-r factors side by side on the fused QKV: `r_m = 3 r`), the scale never does.
Merging folds it into the base: `W + (alpha / rank) B A`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tessera.core.checkpoint import atomic_directory
from tessera.core.files import save_safetensors, sha256_file

FORMAT = "tessera-lora"
FORMAT_VERSION = 1
WEIGHTS_FILE = "adapter.safetensors"
CONFIG_FILE = "adapter.json"


class AdapterError(ValueError):
    """An adapter directory that cannot be used as asked; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What an adapter is, besides its weights (see the module docstring)."""

    rank: int
    alpha: float
    modules: tuple[str, ...]
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    base_checkpoint: str = ""
    base_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise AdapterError(f"LoRA rank must be positive, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        """The factor on `B A x`: `alpha / rank`."""
        return self.alpha / self.rank


def lora_names(module: str) -> tuple[str, str]:
    """The tensor names of a module's A and B factors."""
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def save_adapter(directory: str | os.PathLike, config: AdapterConfig,
                 tensors: dict[str, torch.Tensor], overwrite: bool = False) -> Path:
    """Write an adapter directory atomically (a crash leaves no half-written adapter).

    `tensors` holds exactly the A and B factors of `config.modules`, global shapes.
    """
    _check_tensors(config, {k: tuple(v.shape) for k, v in tensors.items()}, directory)
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        weights = tmp / WEIGHTS_FILE
        save_safetensors({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
                         weights)
        manifest = {"format": FORMAT, "version": FORMAT_VERSION,
                    **{k: list(v) if isinstance(v, tuple) else v
                       for k, v in dataclasses.asdict(config).items()},
                    "sha256": sha256_file(weights)}
        (tmp / CONFIG_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return Path(directory)


def read_adapter_config(directory: str | os.PathLike) -> AdapterConfig:
    """The adapter's config, checked against its weights' names and shapes (not loaded)."""
    directory = Path(directory)
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{directory} is not a LoRA adapter directory (no {CONFIG_FILE}); "
                           "make one with `tessera tune --method lora`")
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{file} is not valid JSON ({exc}); the adapter is damaged") from exc
    if raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
        raise AdapterError(f"{file} is not a {FORMAT} v{FORMAT_VERSION} adapter "
                           f"(format {raw.get('format')!r}, version {raw.get('version')!r})")
    fields = {f.name for f in dataclasses.fields(AdapterConfig)}
    config = AdapterConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in raw.items() if k in fields})
    with safe_open(str(directory / WEIGHTS_FILE), "pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    _check_tensors(config, shapes, directory)
    return config


def load_adapter(directory: str | os.PathLike,
                 verify: bool = True) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """The adapter's config and its global fp32 A/B tensors.

    With `verify`, the weights' sha256 must match the manifest's (a damaged file is refused).
    """
    directory = Path(directory)
    config = read_adapter_config(directory)
    weights = directory / WEIGHTS_FILE
    if verify:
        want = json.loads((directory / CONFIG_FILE).read_text()).get("sha256")
        if want != sha256_file(weights):
            raise AdapterError(f"{weights} does not match the sha256 in {CONFIG_FILE}: the "
                               "adapter is damaged or was edited; export or tune it again")
    from safetensors.torch import load_file

    return config, load_file(str(weights))


def check_base(config: AdapterConfig, fingerprint: str, base: str | os.PathLike) -> None:
    """Refuse to apply an adapter to another base than the one it was tuned on."""
    if config.base_fingerprint and config.base_fingerprint != fingerprint:
        raise AdapterError(
            f"this LoRA adapter was tuned on {config.base_checkpoint or 'another base'} "
            f"(fingerprint {config.base_fingerprint[:12]}), but {base} has different weights "
            f"(fingerprint {fingerprint[:12]}); an adapter only works on the model it was "
            "tuned on: tune it again on this base")


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """`W + scaling * B A`, computed in fp32 and returned in `weight`'s dtype."""
    merged = weight.float() + scaling * (lora_b.float() @ lora_a.float())
    return merged.to(weight.dtype)


def merge_into(weights: dict[str, torch.Tensor], config: AdapterConfig,
               tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of global checkpoint `weights` with every adapted module's weight merged."""
    merged = dict(weights)
    for module in config.modules:
        name = f"{module}.weight"
        if name not in merged:
            raise AdapterError(f"the adapter adapts {module}, which the base does not have")
        a, b = (tensors[n] for n in lora_names(module))
        merged[name] = merge_weight(merged[name], a, b, config.scaling)
    return merged


def _check_tensors(config: AdapterConfig, shapes: dict[str, tuple[int, ...]],
                   where: str | os.PathLike) -> None:
    want = {n for m in config.modules for n in lora_names(m)}
    if set(shapes) != want:
        extra, missing = sorted(set(shapes) - want), sorted(want - set(shapes))
        raise AdapterError(f"adapter {where}: tensors do not match its modules "
                           f"(missing {missing[:4]}, unexpected {extra[:4]})")
    for module in config.modules:
        a, b = (shapes[n] for n in lora_names(module))
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterError(f"adapter {where}: {module} has lora_A {a} and lora_B {b}; "
                               "they must be (r, in) and (out, r)")

