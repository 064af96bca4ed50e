"""FP8 training recipes: which backend runs the FP8 products and how tensors are scaled.

A recipe is resolved once per run from the user's choice and the device
(`resolve_fp8_recipe`), recorded in training checkpoints (`Fp8Recipe.to_dict`) and printed in
the run banner (`Fp8Recipe.describe`). Backends, tried in this order by `backend="auto"`:
- `te`: Transformer Engine on CUDA. Recipes `delayed` (`DelayedScaling`: amax history, margin),
  `tensorwise` (`Float8CurrentScaling`), `block` (`Float8BlockScaling`, 1x128 activations and
  128x128 weights, Hopper) and `mxfp8` (`MXFP8BlockScaling`, Blackwell).
- `torchao`: torchao's float8 training on CUDA (`tensorwise`, `rowwise`, `rowwise-gw-hp`); on
  CPU only when asked for by name, with torchao's `emulate=True`.
- `emulated`: Tessera's own emulation (`core/fp8_training.py`), every device: `delayed` or
  `tensorwise` per-tensor scaling, or torchao's `rowwise` (power-of-two row and column
  scales); quantize to real float8 dtypes, products of the FP8 values in fp32. It is what
  `auto` picks on CPU and what the tests run.
The recipe names `tensorwise` and `rowwise` mean the same scaling under torchao and the
emulation, and `delayed` the same under TE and the emulation.

Formats follow Transformer Engine's names: `hybrid` is e4m3 for activations and weights in the
forward and e5m2 for gradients in the backward; `e4m3` uses e4m3 everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from tessera.core.config import ConfigError

BACKENDS = ("auto", "te", "torchao", "emulated")
RECIPES: dict[str, tuple[str, ...]] = {
    "te": ("delayed", "tensorwise", "block", "mxfp8"),
    "torchao": ("tensorwise", "rowwise", "rowwise-gw-hp"),
    "emulated": ("delayed", "tensorwise", "rowwise"),
}
DEFAULT_RECIPE = {"te": "delayed", "torchao": "tensorwise", "emulated": "delayed"}
ALIASES = {"current": "tensorwise", "blockwise": "block"}
FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")
INSTALL_TE = 'pip install --no-build-isolation "tessera[te]" (on a CUDA machine)'
INSTALL_TORCHAO = 'pip install "tessera[fp8]" (torchao)'


@dataclass(frozen=True)
class Fp8Recipe:
    """A resolved FP8 recipe. `amax_history_len`, `margin` and `amax_compute_algo` matter to
    the `delayed` recipe only (as in TE's `DelayedScaling`); `emulate` marks torchao's CPU mode."""

    backend: str
    recipe: str
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    margin: int = 0
    amax_compute_algo: str = "max"
    emulate: bool = False

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Fp8Recipe:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def describe(self) -> str:
        """One line for the banner, e.g. `fp8 emulated, delayed scaling (amax history 16, ...)`."""
        backend = {"te": "Transformer Engine", "emulated": "emulated on Tessera's own path",
                   "torchao": "torchao float8" + (" (emulate=True)" if self.emulate else "")}
        fmt = ("hybrid: e4m3 forward, e5m2 gradients" if self.fp8_format == "hybrid"
               else "e4m3 everywhere")
        text = f"fp8 via {backend[self.backend]}, recipe {self.recipe} ({fmt}"
        if self.recipe == "delayed":
            text += (f"; amax history {self.amax_history_len}, margin {self.margin}, "
                     f"amax {self.amax_compute_algo}")
        return text + ")"


def offered_recipes() -> str:
    """Every backend's recipes, for error messages: `te: delayed, ...; torchao: ...`."""
    return "; ".join(f"{b}: {', '.join(rs)}" for b, rs in RECIPES.items())


def torchao_available() -> bool:
    """True when `torchao.float8` can be imported (the optional `fp8` extra)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # an ABI mismatch with this torch raises at import
        return False
    return True


def resolve_fp8_recipe(device: torch.device | str, backend: str = "auto", recipe: str = "auto",
                       *, fp8_format: str = "hybrid", amax_history_len: int = 1024,
                       margin: int = 0, amax_compute_algo: str = "max") -> Fp8Recipe:
    """The recipe a run on `device` uses, or a `ConfigError` saying what to install or change.

    `backend="auto"`: on CUDA Transformer Engine when it imports and offers `recipe`, else
    torchao; elsewhere the emulated path. `recipe="auto"`: the backend's default (`delayed` for
    TE and the emulation, `tensorwise` for torchao).
    """
    from tessera.core.te_backend import transformer_engine_available

    recipe = ALIASES.get(recipe, recipe)
    problems = []
    if backend not in BACKENDS:
        problems.append(f"unknown fp8 backend {backend!r}; use {', '.join(BACKENDS)}")
    known = {r for rs in RECIPES.values() for r in rs}
    if recipe != "auto" and recipe not in known:
        problems.append(f"unknown fp8 recipe {recipe!r}; use auto or {', '.join(sorted(known))}")
    if fp8_format not in FORMATS:
        problems.append(f"unknown fp8 format {fp8_format!r}; use {' or '.join(FORMATS)}")
    if amax_history_len < 1:
        problems.append(f"fp8 amax history length must be >= 1, got {amax_history_len}")
    if margin < 0:
        problems.append(f"fp8 margin must be >= 0, got {margin}")
    if amax_compute_algo not in AMAX_ALGOS:
        problems.append(f"unknown amax compute algo {amax_compute_algo!r}; use "
                        f"{' or '.join(AMAX_ALGOS)}")
    if problems:
        raise ConfigError("invalid fp8 settings:\n  - " + "\n  - ".join(problems))
    cuda = torch.device(device).type == "cuda"
    checks = {"te": lambda: transformer_engine_available(device), "torchao": torchao_available,
              "emulated": lambda: True}  # called only when needed: importing torchao is slow
    if backend == "auto":
        order = ("te", "torchao") if cuda else ("emulated",)
        fits = [b for b in order if (recipe == "auto" or recipe in RECIPES[b]) and checks[b]()]
        if not fits:
            offered = [b for b in RECIPES if recipe in RECIPES[b]]
            if not cuda:
                raise ConfigError(f"fp8 recipe {recipe!r} needs a CUDA device ({' or '.join(offered)}); "
                                  "on CPU the emulated path offers "
                                  f"{', '.join(RECIPES['emulated'])} (by backend: "
                                  f"{offered_recipes()})")
            raise ConfigError(f"fp8 recipe {recipe!r} on CUDA needs {' or '.join(offered)}, and "
                              f"neither imports: {INSTALL_TE}, or {INSTALL_TORCHAO}; or pass "
                              "--fp8-backend emulated to emulate FP8 without them")
        backend = fits[0]
    elif not checks[backend]():
        if backend == "te":
            raise ConfigError("--fp8-backend te needs a CUDA device and Transformer Engine "
                              f"({INSTALL_TE}); without them use --fp8-backend auto")
        raise ConfigError(f"--fp8-backend torchao needs torchao: {INSTALL_TORCHAO}")
    if recipe == "auto":
        recipe = DEFAULT_RECIPE[backend]
    if recipe not in RECIPES[backend]:
        raise ConfigError(f"fp8 backend {backend} offers the recipes "
                          f"{', '.join(RECIPES[backend])}, not {recipe!r} (by backend: "
                          f"{offered_recipes()})")
    if backend in ("torchao",) and fp8_format != "hybrid" and recipe == "tensorwise":
        raise ConfigError("torchao's tensorwise recipe uses the hybrid format (e5m2 gradients); "
                          "drop --fp8-format e4m3 or use --fp8-recipe rowwise (e4m3 everywhere)")
    if recipe in ("rowwise", "rowwise-gw-hp", "block", "mxfp8"):
        fp8_format = "e4m3"  # these recipes keep gradients in e4m3 too
    return Fp8Recipe(backend, recipe, fp8_format, amax_history_len, margin, amax_compute_algo,
                     emulate=backend == "torchao" and not cuda)
