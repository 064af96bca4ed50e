"""Fused elementwise kernels for training: RMSNorm, SwiGLU, rotary embedding, cross-entropy.

Eager PyTorch runs each of these as 5-10 separate passes over the activations in each
direction (upcast, square, mean, multiply, downcast, ...), and on a CPU those passes cost as
much as the matrix multiplies of a small model. TorchInductor compiles each function here into
one or two loops per direction. The functions are plain PyTorch with the rounding points of
the reference implementations (Hugging Face's: RMSNorm normalises in fp32 and rounds before
the weight; the loss is computed from fp32 logits), so compiled and eager results agree to
float reassociation.

When: `TESSERA_FUSED_KERNELS` = `auto` (default), `on` or `off`. `auto` and `on` use the
compiled kernels while autograd is recording (training and tuning steps); inference always runs
eager, because decode shapes change every step and its time goes to the weights, not to these
passes. `auto` falls back to eager, with one warning, when compilation fails (no C++ compiler,
an unsupported platform); `on` raises instead. Shapes may vary between calls: after the first
shape change a function is recompiled once with dynamic shapes. A function is compiled once per
set of input dtypes, with autocast on or off (it runs with autocast off, which changes none of
these formulas), and is traced inline, not compiled apart, inside a compiled block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch._functorch.config
import torch.nn.functional as F

from tessera.core.compile_cache import key_compile_cache_by_isa
from tessera.core.env_switch import EnvSwitch

log = logging.getLogger(__name__)

_switch = EnvSwitch("TESSERA_FUSED_KERNELS", "fused kernel")
_failed = False  # `auto` saw a compile failure: eager from then on

F_ = TypeVar("F_", bound=Callable[..., torch.Tensor])

# Pipeline schedules that split backward into input and weight gradients run it with
# retain_graph, which a backward kernel given donated buffers refuses. The donation only saves a
# temporary per kernel; this is the one switch torch offers (read at compile time, process-wide).
torch._functorch.config.donated_buffer = False


def set_mode(mode: str | None) -> None:
    """Set the mode (`auto`, `on`, `off`), or `None` to read `TESSERA_FUSED_KERNELS` again."""
    global _failed
    _switch.set(mode)
    _failed = False


def mode() -> str:
    return _switch.get()


def training(x: torch.Tensor) -> bool:
    """`fusable`'s default `when`: autograd is recording through `x` (a training step)."""
    return torch.is_grad_enabled() and x.requires_grad


def fusable(fn: F_ | None = None, *, when: Callable[[torch.Tensor], bool] = training,
            dynamic: bool | None = None):
    """`fn` itself, or its TorchInductor-compiled version (`torch.compile(fn, dynamic=...)`)
    for the calls whose first argument satisfies `when` (default: training; see the module
    doc), under the mode switch and with the fallback to eager described there. Use as
    `@fusable` or `fusable(fn, when=..., dynamic=...)`.

    The compiled version is made on the first call that wants it (`dispatch.compiled()` makes
    it on demand): `torch.compile` imports TorchDynamo and Inductor, seconds of CPU that
    inference, the converters and every `--help` would otherwise pay at import.
    """
    if fn is None:
        return functools.partial(fusable, when=when, dynamic=dynamic)
    compiled: Callable[..., torch.Tensor] | None = None

    def get_compiled() -> Callable[..., torch.Tensor]:
        nonlocal compiled
        if compiled is None:
            key_compile_cache_by_isa()
            compiled = torch.compile(fn, dynamic=dynamic)
        return compiled

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        global _failed
        # `is_compiling()` first: traced inside a compiled region (a compiled block), the
        # formula is inlined, and reading `_mode` / `_failed` there would guard the region on
        # them (first read sets `_mode`, so its second call would fail the guard, recompile).
        if torch.compiler.is_compiling() or not when(x) or mode() == "off" or _failed:
            return fn(x, *args, **kwargs)
        try:
            compiled = get_compiled()
            device = x.device.type
            if not torch.is_autocast_enabled(device):
                return compiled(x, *args, **kwargs)
            # A compiled function is guarded on the autocast state, and none of these formulas
            # has an op autocast would cast (each upcasts itself where it needs fp32): called
            # with autocast off, a mixed-precision step reuses the graphs of its input dtypes.
            with torch.autocast(device, enabled=False):
                return compiled(x, *args, **kwargs)
        except Exception as error:  # compile failures surface on the first call
            if mode() == "on":
                raise
            _failed = True
            log.warning("fused kernels disabled, running eager: compiling %s failed (%s: %s). "
                        "Set TESSERA_FUSED_KERNELS=off to skip the attempt.",
                        fn.__name__, type(error).__name__, str(error).splitlines()[0][:200])
            return fn(x, *args, **kwargs)

    dispatch.eager = fn  # the reference formula, for tests
    dispatch.compiled = get_compiled  # the compiled one, whatever `when` says (benches, tests)
    return dispatch


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)`, normalised in fp32 and rounded to `x.dtype` before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@fusable
def swiglu(h: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `h = [gate, up]` along the last dimension."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@fusable
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `cos.shape[-1]` dims of `x`; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    a, b = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos + torch.cat([-b, a], dim=-1) * sin
    return torch.cat([x_rot, x_pass], dim=-1) if x_pass.shape[-1] else x_rot


@fusable
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-token cross-entropy `(N,)` in fp32 from logits `(N, V)`; 0 where ignored."""
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
