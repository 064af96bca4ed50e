"""FP8 training of the block linears: `enable_fp8_training` turns it on for a run's model
chunks and returns the `Fp8Training` the loop drives (autocast context, per-step scale update,
checkpointed state).

Which layers: the ones `weight_format.quantizable` names (fused QKV, attention output, MLP in
and out of every block), the rule inference's FP8 and int8 formats and Transformer Engine share;
embeddings, norms and the output layer stay in the run's bf16. FP8 GEMMs on GPUs want both
matrix dimensions of the (local) weight to be multiples of 16: a layer whose shard is not stays
in bf16 and is listed (`Fp8Training.fallback`); under Transformer Engine, which would fail on
it, that is an error naming the layers.

The emulated backend (a weight format, `EmulatedFp8`): in the forward the input and the weight
are quantized to e4m3 with per-tensor scales `s = fp8_max / amax / 2**margin`
(`q = clamp(x * s, -max, max).to(float8)`, saturating), and the product of the FP8 values is
taken in fp32 and divided by both scales, which is what `torch._scaled_mm` computes (on GPUs
with FP8 tensor cores it is `_scaled_mm`, fast accumulation in the forward only, so there the
"emulation" runs real FP8 GEMMs); in the backward the output gradient is quantized likewise
(e5m2 in the `hybrid` format) and multiplied by the saved FP8 input and weight. Scales come from
- `delayed`: the layer's amax history (TE's `DelayedScaling`): each step records the amaxes it
  sees, `step_end` reduces them (max over tensor- and data-parallel ranks, one all-reduce per
  group for all layers), takes the max over the last `amax_history_len` steps (or the most
  recent one) and sets the scales the next step uses; the first step uses scale 1, as TE does.
  Forwards without autograd (evaluation) use the scales and record nothing.
- `tensorwise` (current scaling): each tensor's own amax, taken over tensor-parallel ranks when
  the tensor is split across them (the weight; a row-parallel input; a column-parallel output
  gradient), so every layout quantizes to the values one process would.
- `rowwise` (torchao's recipe of that name): e4m3 everywhere, one scale per row or column along
  the dimension each product sums over, rounded down to a power of two (so scaling is exact):
  `y = x @ W^T` scales x per row and W per output channel; `dx = g @ W` scales g per row and W
  per input feature; `dW = g^T @ x` scales g per output feature and x per input feature, over
  the tokens. A scale's amax is taken over tensor-parallel ranks when the dimension it reduces
  is split (the input features under a row split, the output features under a column split).
  The backward re-quantizes the saved input and weight along the other dimension, so the
  high-precision input is saved (as in torchao).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.config import ConfigError
from tessera.core.fp8 import fp8_max, quantize_fp8, scale_from_amax
from tessera.core.fp8_recipe import Fp8Recipe
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.parallel.weight_format import DENSE, WeightFormat, quantizable

INPUT, WEIGHT, GRAD = 0, 1, 2  # rows of a layer's amax history / entries of its scales
GEMM_MULTIPLE = 16
# The dimensions of each 2-D operand: tokens M, input features K, output features N. A
# row-parallel layer splits K across tensor-parallel ranks, a column-parallel one N.
_DIMS = {INPUT: ("M", "K"), WEIGHT: ("N", "K"), GRAD: ("M", "N")}
_SPLIT = {"row": "K", "column": "N"}


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` through FP8 and back (`q / scale`) in `x.dtype`: the values an FP8 GEMM reads."""
    return (quantize_fp8(x, scale, dtype).float() / scale).to(x.dtype)


def fp8_matmul(qa: torch.Tensor, scale_a: torch.Tensor, qb: torch.Tensor,
               scale_b: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """`(qa / scale_a) @ (qb / scale_b)` in fp32 for FP8 `qa (M, K)`, `qb (K, N)` and per-tensor
    scales (`()`) or row scales (`(M, 1)`, `(1, N)`): the exact FP8 products accumulated in
    fp32, scaled once at the end.

    On GPUs with FP8 tensor cores (`fp8_gemm_fits`) it is `torch._scaled_mm` itself (with
    Hopper's fast accumulation when `fast_accum`); elsewhere the same sum in fp32 matmuls.
    """
    rowwise = scale_a.dim() > 0
    if fp8_gemm_fits(qa, qb, rowwise):
        # Row scales (`(M, 1)` and `(1, N)`) take the kernel that returns bf16.
        out = torch.bfloat16 if rowwise else torch.float32
        return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(),
                                scale_a=scale_a.reciprocal().contiguous(),
                                scale_b=scale_b.reciprocal().contiguous(),
                                out_dtype=out, use_fast_accum=fast_accum).float()
    return (qa.float() @ qb.float()) / (scale_a * scale_b)


def fp8_gemm_fits(qa: torch.Tensor, qb: torch.Tensor, rowwise: bool = False) -> bool:
    """Whether `torch._scaled_mm` runs `qa @ qb` on this GPU's FP8 tensor cores (compute
    capability 8.9+, 9.0+ for row scales; every dimension a multiple of 16; not both operands
    e5m2)."""
    need = (9, 0) if rowwise else (8, 9)
    return (qa.is_cuda and torch.cuda.get_device_capability(qa.device) >= need
            and all(d % GEMM_MULTIPLE == 0 for d in (*qa.shape, qb.shape[1]))
            and not qa.dtype == qb.dtype == torch.float8_e5m2)


class _Run:
    """How one call of an emulated FP8 linear gets its scales (see the module docstring)."""

    def __init__(self, layer: ParallelLinear, recipe: Fp8Recipe, record: bool):
        self.layer, self.recipe, self.record = layer, recipe, record

    def scale(self, kind: int, t: torch.Tensor, dtype: torch.dtype, dim: int | None = None
              ) -> torch.Tensor:
        """The scale of the 2-D operand `t` (`kind`): per tensor, or with `dim` one per row
        (`dim=-1`, shape `(rows, 1)`) or per column (`dim=0`, `(1, cols)`), power-of-two."""
        layer = self.layer
        if self.recipe.recipe == "delayed":
            if self.record:
                amax = t.detach().abs().amax().float()
                row = layer.fp8_amax_history[0]
                row[kind] = torch.maximum(row[kind], amax)
            return layer.fp8_scale[kind].clone()
        t = t.detach().abs()
        amax = (t.amax() if dim is None else t.amax(dim=dim, keepdim=True)).float()
        dims = _DIMS[kind] if dim is None else (_DIMS[kind][dim],)
        if layer.tp_group is not None and _SPLIT[layer.parallel] in dims:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=layer.tp_group)
        scale = scale_from_amax(amax, dtype)
        return scale if dim is None else torch.exp2(torch.floor(torch.log2(scale)))


class _EmulatedFp8Linear(torch.autograd.Function):
    """`x @ W^T` with FP8 inputs, weight and output gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, run: _Run, out_dtype: torch.dtype):
        if run.recipe.recipe == "rowwise":
            return _rowwise_forward(ctx, x, weight, run, out_dtype)
        fwd = run.recipe.forward_dtype
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            sx, sw = run.scale(INPUT, x2, fwd), run.scale(WEIGHT, weight, fwd)
            qx, qw = quantize_fp8(x2, sx, fwd), quantize_fp8(weight, sw, fwd)
            y = fp8_matmul(qx, sx, qw.t(), sw, fast_accum=True)  # forward only
        ctx.save_for_backward(qx, qw, sx, sw)
        ctx.run, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = run, x.shape, x.dtype, weight.dtype
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.run.recipe.recipe == "rowwise":
            return _rowwise_backward(ctx, grad_y)
        qx, qw, sx, sw = ctx.saved_tensors
        run = ctx.run
        run.record = True  # gradients exist only in training
        bwd = run.recipe.backward_dtype
        grad_x = grad_w = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g2 = grad_y.reshape(-1, grad_y.shape[-1])
            sg = run.scale(GRAD, g2, bwd)
            qg = quantize_fp8(g2, sg, bwd)
            if ctx.needs_input_grad[0]:
                grad_x = fp8_matmul(qg, sg, qw, sw).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = fp8_matmul(qg.t(), sg, qx, sx).to(ctx.w_dtype)
        return grad_x, grad_w, None, None


def _quantized(run: _Run, kind: int, t: torch.Tensor, dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of `t` in e4m3 with one scale per row (`dim=-1`) or column (`dim=0`)."""
    scale = run.scale(kind, t, torch.float8_e4m3fn, dim)
    return quantize_fp8(t, scale, torch.float8_e4m3fn), scale


def _rowwise_forward(ctx, x: torch.Tensor, weight: torch.Tensor, run: _Run,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`y = x @ W^T`, x per row and W per output channel (the `rowwise` recipe)."""
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = _quantized(run, INPUT, x2, -1)
        qw, sw = _quantized(run, WEIGHT, weight, -1)
        y = fp8_matmul(qx, sx, qw.t(), sw.t(), fast_accum=True)  # forward only
    ctx.save_for_backward(x2, weight)
    ctx.run, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = run, x.shape, x.dtype, weight.dtype
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def _rowwise_backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """`dx = g @ W` (g per row, W per input feature) and `dW = g^T @ x` (g per output
    feature, x per input feature), every operand e4m3 (the `rowwise` recipe)."""
    x2, weight = ctx.saved_tensors
    run = ctx.run
    grad_x = grad_w = None
    with torch.autocast(grad_y.device.type, enabled=False):
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        if ctx.needs_input_grad[0]:
            qg, sg = _quantized(run, GRAD, g2, -1)
            qw, sw = _quantized(run, WEIGHT, weight, 0)
            grad_x = fp8_matmul(qg, sg, qw, sw).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            qg, sg = _quantized(run, GRAD, g2, 0)
            qx, sx = _quantized(run, INPUT, x2, 0)
            grad_w = fp8_matmul(qg.t(), sg.t(), qx, sx).to(ctx.w_dtype)
    return grad_x, grad_w, None, None


class EmulatedFp8(WeightFormat):
    """FP8 training, emulated: the weight stays a trainable parameter (the fp32 master copy);
    each product goes through FP8. The layer holds the state (`fp8_amax_history (L, 3)`,
    `fp8_scale (3,)`: input, weight, output gradient) as non-persistent buffers, so weight
    files and `state_dict` are unchanged; `Fp8Training` saves them."""

    name = "fp8-train"

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe

    def __repr__(self) -> str:
        return f"EmulatedFp8({self.recipe.recipe}, {self.recipe.fp8_format})"

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        out_dtype = (torch.get_autocast_dtype(x.device.type)
                     if torch.is_autocast_enabled(x.device.type) else x.dtype)
        run = _Run(layer, self.recipe, record=torch.is_grad_enabled())
        y = _EmulatedFp8Linear.apply(x, layer.weight, run, out_dtype)
        return y if bias is None else y + bias.to(y.dtype)


class TorchaoFp8(WeightFormat):
    """FP8 training through torchao's `Float8Linear` (tensorwise or rowwise dynamic scaling),
    reading the layer's own weight parameter. Scales are each rank's own (torchao takes the amax
    of the local shard), so under tensor parallelism they differ from one process's."""

    name = "fp8-torchao"

    def __init__(self, layer: ParallelLinear, recipe: Fp8Recipe):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        name = {"tensorwise": "tensorwise", "rowwise": "rowwise",
                "rowwise-gw-hp": "rowwise_with_gw_hp"}[recipe.recipe]
        config = Float8LinearConfig.from_recipe_name(name)
        if recipe.emulate:
            config = _replace(config, emulate=True)
        out_local, in_local = layer.weight.shape
        with torch.device("meta"):
            self.module = Float8Linear(in_local, out_local, bias=False, config=config)
        self.recipe = recipe

    def __repr__(self) -> str:
        return f"TorchaoFp8({self.recipe.recipe})"

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        self.module._parameters["weight"] = layer.weight  # FSDP2 swaps it between steps
        y = self.module(x)
        return y if bias is None else y + bias.to(y.dtype)


def _replace(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)


class Fp8Training:
    """The FP8 side of a training run: which layers run in FP8, the autocast context the
    forward and backward run in, the per-step scale update and the state checkpoints hold.

    Layers are named by their global weight name without `.weight`
    (`layers.3.attention.wqkv`). `fallback` lists `(name, local shape)` of the layers left in
    bf16 because a dimension of their shard is not a multiple of 16.
    """

    def __init__(self, recipe: Fp8Recipe, layers: dict[str, nn.Module],
                 fallback: list[tuple[str, tuple[int, int]]], groups: Any):
        self.recipe, self.layers, self.fallback, self.groups = recipe, layers, fallback, groups
        self._top: torch.Tensor | None = None

    def describe(self) -> str:
        text = f"{self.recipe.describe()}; {len(self.layers)} block linear(s) in FP8"
        if self.fallback:
            text += ", in bf16 (a dimension not a multiple of 16): " + ", ".join(
                f"{name} {out}x{inp}" for name, (out, inp) in self.fallback)
        return text

    def record(self) -> dict[str, Any]:
        """What the checkpoint manifest records: the recipe and the layers left in bf16."""
        return {**self.recipe.to_dict(), "fp8_layers": len(self.layers),
                "bf16_fallback": [name for name, _ in self.fallback]}

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context forward (and so backward) runs in: TE's `fp8_autocast`, else nothing."""
        if self.recipe.backend != "te":
            yield
            return
        import transformer_engine.pytorch as te

        with te.fp8_autocast(enabled=True, fp8_recipe=te_recipe(self.recipe),
                             fp8_group=self.groups.tp_group if self.groups else None):
            yield

    def _maxima(self, device: torch.device) -> torch.Tensor:
        """The FP8 maxima of input, weight and gradient `(3,)` on `device`, made once, by fills
        (a tensor from a Python list would be a host-to-device copy, a stream sync, per step)."""
        top = self._top
        if top is None or top.device != device:
            top = torch.full((3,), fp8_max(self.recipe.forward_dtype), device=device)
            top[GRAD].fill_(fp8_max(self.recipe.backward_dtype))
            self._top = top
        return top

    @torch.no_grad()
    def step_end(self) -> None:
        """After a step's backward: fold the recorded amaxes into the history and set the next
        step's scales (delayed scaling, emulated). Collective over the tp and dp x cp groups."""
        if self.recipe.backend != "emulated" or self.recipe.recipe != "delayed" or not self.layers:
            return
        layers = list(self.layers.values())
        current = torch.stack([layer.fp8_amax_history[0] for layer in layers])
        # dp x cp: cp ranks see other tokens of the same sequences, dp ranks other sequences.
        for group in (self.groups.tp_group, self.groups.dp_cp_group) if self.groups else ():
            if group is not None:
                dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
        r = self.recipe
        top = self._maxima(current.device)
        for layer, now in zip(layers, current):
            history = layer.fp8_amax_history
            history[0] = now
            amax = history.amax(dim=0) if r.amax_compute_algo == "max" else history[0]
            layer.fp8_scale.copy_(scale_from_amax(amax, top, r.margin, previous=layer.fp8_scale))
            history.copy_(history.roll(1, dims=0))
            history[0].fill_(0.0)  # a fill: `= 0.0` would build a tensor from host data

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's FP8 state by global layer name: amax history and scales (emulated
        delayed scaling), TE's serialized FP8 metadata (Transformer Engine); else nothing."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            if hasattr(layer, "fp8_amax_history"):
                out[f"{name}.amax_history"] = layer.fp8_amax_history.detach().cpu().clone()
                out[f"{name}.scale"] = layer.fp8_scale.detach().cpu().clone()
            elif self.recipe.backend == "te":
                extra = layer.get_extra_state()
                if isinstance(extra, torch.Tensor) and extra.numel():
                    out[f"{name}.te_extra_state"] = extra.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Restore what `state_tensors` saved (from any layout: names are global)."""
        for name, layer in self.layers.items():
            if hasattr(layer, "fp8_amax_history"):
                history, scale = (tensors.get(f"{name}.amax_history"),
                                  tensors.get(f"{name}.scale"))
                if history is None or scale is None:
                    raise ConfigError(f"{source} has no FP8 state for {name}; it was saved by "
                                      "another recipe or layout of FP8 layers")
                if history.shape != layer.fp8_amax_history.shape:
                    raise ConfigError(f"{source}: {name} has an amax history of "
                                      f"{history.shape[0]} steps, this run keeps "
                                      f"{layer.fp8_amax_history.shape[0]}; resume with the "
                                      "saved --fp8-amax-history-len")
                layer.fp8_amax_history.copy_(history)
                layer.fp8_scale.copy_(scale)
            elif f"{name}.te_extra_state" in tensors:
                layer.set_extra_state(tensors[f"{name}.te_extra_state"])


def te_recipe(recipe: Fp8Recipe) -> Any:
    """Transformer Engine's recipe object for `recipe` (a clear error when this TE lacks it)."""
    from transformer_engine.common import recipe as te_recipes

    fmt = te_recipes.Format.HYBRID if recipe.fp8_format == "hybrid" else te_recipes.Format.E4M3
    if recipe.recipe == "delayed":
        return te_recipes.DelayedScaling(fp8_format=fmt, amax_history_len=recipe.amax_history_len,
                                         amax_compute_algo=recipe.amax_compute_algo,
                                         margin=recipe.margin)
    cls = {"tensorwise": "Float8CurrentScaling", "block": "Float8BlockScaling",
           "mxfp8": "MXFP8BlockScaling"}[recipe.recipe]
    if not hasattr(te_recipes, cls):
        raise ConfigError(f"this Transformer Engine has no {cls} (fp8 recipe {recipe.recipe}); "
                          "upgrade it (tensorwise needs TE >= 2.2, block >= 2.3) or use "
                          "--fp8-recipe delayed")
    return getattr(te_recipes, cls)(fp8_format=fmt)


def _fits_gemm(shape: tuple[int, ...]) -> bool:
    return all(d % GEMM_MULTIPLE == 0 for d in shape)


def enable_fp8_training(stages: list[nn.Module], recipe: Fp8Recipe, groups: Any = None
                        ) -> Fp8Training:
    """Put the `quantizable` linears of every model chunk in `stages` into FP8 training under
    `recipe`; returns the run's `Fp8Training`.

    Call it after the model is built (under TE: built with `backend="te"`) and before the
    optimizer (the parameters do not change, but that keeps one order for every backend).
    """
    layers: dict[str, nn.Module] = {}
    fallback: list[tuple[str, tuple[int, int]]] = []
    for model in stages:
        global_name = getattr(model, "global_name", lambda n: n)
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or not quantizable(f"{name}.weight"):
                continue
            gname = global_name(f"{name}.weight").removesuffix(".weight")
            shape = tuple(weight.shape)
            if not _fits_gemm(shape):
                fallback.append((gname, shape))
                continue
            layers[gname] = module
    if recipe.backend == "te":
        if fallback:
            raise ConfigError("Transformer Engine's FP8 GEMMs need weight dimensions that are "
                              "multiples of 16; these shards are not: " + ", ".join(
                                  f"{n} {o}x{i}" for n, (o, i) in fallback)
                              + ". Change the model sizes (or tp), or use --fp8-backend torchao, "
                              "which leaves such layers in bf16")
        return Fp8Training(recipe, layers, fallback, groups)
    for module in layers.values():
        if not isinstance(module, ParallelLinear) or module.format is not DENSE:
            raise ConfigError(f"FP8 training needs dense trainable linears; found {module!r}")
        if recipe.backend == "torchao":
            module.format = TorchaoFp8(module, recipe)
            continue
        device = module.weight.device
        module.register_buffer("fp8_amax_history", torch.zeros(
            recipe.amax_history_len, 3, device=device), persistent=False)
        module.register_buffer("fp8_scale", torch.ones(3, device=device), persistent=False)
        module.format = EmulatedFp8(recipe)
    return Fp8Training(recipe, layers, fallback, groups)
