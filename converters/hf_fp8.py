"""FP8 Hugging Face checkpoints in the two forms vLLM, SGLang and transformers load.

`--fp8 block` (`quant_method: "fp8"`, the DeepSeek-V3 / Qwen3-FP8 convention; transformers'
`FineGrainedFP8Config`, vLLM's `Fp8Config`): every quantized linear stores `weight` in
float8_e4m3fn and `weight_scale_inv`, fp32, one per `b x b` block (shape `(out / b, in / b)`),
with `activation_scheme: "dynamic"`. Despite its name the scale is a multiplier: the loaders
dequantize `w = weight.float() * weight_scale_inv` per block (transformers'
`Fp8Dequantize._dequantize_one`).

`--fp8 tensor` (`quant_method: "compressed-tensors"`, `format: "float-quantized"`, the
llm-compressor `FP8` scheme): per-tensor `weight_scale` (fp32, shape `(1,)`, a multiplier as
well) and, after calibration, `input_scale = input amax / 448` with static activations; without
calibration the activations are dynamic. Not `quant_method: "fp8"` per tensor, because the two
loaders disagree on its tensor names: vLLM reads `weight_scale` / `input_scale`, transformers
5.x only `weight_scale_inv` / `activation_scale`, so no one file loads in both. compressed-tensors
loads in vLLM natively and in transformers with the `compressed-tensors` package installed.
q/k/v and gate/up share one scale (the amax of Tessera's fused tensor), so vLLM, which fuses
them and keeps the largest scale, has nothing to requantize.

The linears quantized (`hf_quantizable`) are the four of every block (`weight_format.quantizable`,
the rule Tessera's own FP8 checkpoints follow) and DeepSeek's latent-attention projections,
routed experts (each expert's `gate/up/down_proj` in the file, per tensor one scale per
expert) and shared experts, as DeepSeek-V3's own FP8 checkpoint stores them; embeddings, norms,
routers (with their expert bias) and the output layer keep the export dtype and are listed in
`modules_to_not_convert` (`ignore` for compressed-tensors). transformers 5 loads the per-expert
FP8 tensors into its fused in-memory experts (dequantizing on CPU). The
quantizer is `core.fp8.quantize` (scale `448 / amax`); its reciprocal is what is stored.
Families: those whose mapping says `fp8_export` (`converters.hf`; Qwen3's per-head q/k norms
are norms, so not converted either). Calibrated static input scales cover the four block
linears only, so DeepSeek's per-tensor export is dynamic. The other Mixture-of-Experts families
are refused.

Import (`dequantizing_reader`) reads either form, and vLLM's per-tensor `quant_method: "fp8"`
too, dequantizing each weight to fp32 exactly as the loaders do (`q.float() * scale`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.converters.hf.registry import hf_family, mapped_families
from tessera.converters.hf_mapping import ConversionError, Read, hf_parts, tensor_pairs
from tessera.core.config import ModelConfig
from tessera.core.fp8 import E4M3_MAX, Block, check_blocks, expand_blocks, quantize, weight_amax
from tessera.core.parallel.sharding import global_param_shapes
from tessera.core.parallel.weight_format import quantizable

SCHEMES = ("block", "tensor")
DEFAULT_BLOCK = 128
_SCALE_NAMES = ("weight_scale_inv", "weight_scale")
_INPUT_SCALE_NAMES = ("input_scale", "activation_scale")


@dataclass(frozen=True)
class Fp8Export:
    """What `--fp8` asks for: `scheme` "block" (with `block` rows and columns per scale) or
    "tensor"; `input_amax` (Tessera weight name -> calibrated input amax) makes a per-tensor
    export's activations static."""

    scheme: str
    block: int = DEFAULT_BLOCK
    input_amax: dict[str, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConversionError(f"FP8 scheme {self.scheme!r} cannot be exported to Hugging "
                                  f"Face; choose one of {', '.join(SCHEMES)}")
        if self.block <= 0:
            raise ConversionError(f"the FP8 block size must be positive, not {self.block}")
        if self.scheme == "block" and self.input_amax is not None:
            raise ConversionError("block FP8 has dynamic activations only (as vLLM and "
                                  "transformers load it); calibration data needs --fp8 tensor")

    @property
    def block_shape(self) -> Block | None:
        return (self.block, self.block) if self.scheme == "block" else None


def fp8_families() -> list[str]:
    """The families whose Hugging Face linears the FP8 loaders quantize."""
    return [f for f in mapped_families() if hf_family(f).fp8_export]


def check_fp8_exportable(config: ModelConfig, spec: Fp8Export) -> None:
    """Raise ConversionError if `config` cannot be written in `spec`'s form: a family whose HF
    linears the FP8 loaders do not quantize, or a dimension the block does not divide."""
    family = hf_family(config.family)
    if not family.fp8_export and config.moe.num_experts:
        raise ConversionError(
            f"FP8 Hugging Face export supports the families {', '.join(fp8_families())}, "
            f"not the Mixture-of-Experts family {config.family!r}: {family.fp8_refusal}; "
            "export it without --fp8")
    if not family.fp8_export:
        raise ConversionError(
            f"FP8 Hugging Face export supports the families {', '.join(fp8_families())}, not "
            f"{config.family!r}: {family.fp8_refusal}; export it without --fp8")
    if spec.input_amax is not None:
        uncalibrated = [name for name, _ in tensor_pairs(config)
                        if hf_quantizable(name) and name not in spec.input_amax]
        if uncalibrated:  # calibration sees the four block linears only, not MLA or experts
            raise ConversionError(
                f"--calibration-data records the inputs of the wqkv/wo/w1/w2 linears only, not "
                f"{uncalibrated[0]} of {config.family!r}; export it with --fp8 tensor without "
                "--calibration-data (dynamic activations) or with --fp8 block")
    if spec.block_shape is None:
        return
    parts = [(hf_name, part.shape) for name, targets in tensor_pairs(config)
             if hf_quantizable(name)
             for hf_name, part in hf_parts(config, name, torch.empty(
                 global_param_shapes(config)[name], device="meta"), targets)]
    for hf_name, shape in parts:
        check_blocks(shape, spec.block_shape, hf_name, [s for _, s in parts])


_LATENT_AND_EXPERT_LINEARS = re.compile(
    r"(^|\.)layers\.\d+\.(attention\.(wq|wq_a|wq_b|wkv_a|wkv_b)\.weight"
    r"|feed_forward\.(experts\.(w1|w2)|shared_expert\.(w1|w2)\.weight))$")


def hf_quantizable(name: str) -> bool:
    """True for a Tessera weight whose HF linears the export quantizes: `quantizable`'s four
    block linears, and the latent-attention projections, routed experts (each expert's
    `gate/up/down_proj` in the file) and shared experts of the MoE families. Routers (and
    their expert bias) are not: DeepSeek-V3's own FP8 checkpoint keeps them high precision."""
    return quantizable(name) or _LATENT_AND_EXPERT_LINEARS.search(name) is not None


def _module(hf_name: str) -> str:
    return hf_name.rsplit(".", 1)[0]


def modules_to_not_convert(config: ModelConfig) -> list[str]:
    """The HF modules left in high precision: embeddings, norms and `lm_head` (a module even
    when its weight is tied to the embeddings), in model order."""
    names: dict[str, None] = {}
    for name, targets in tensor_pairs(config):
        if not hf_quantizable(name) and not name.endswith(".bias"):
            names.update((_module(hf_name), None) for hf_name, _ in targets)
    names["lm_head"] = None
    return list(names)


def quantization_config(config: ModelConfig, spec: Fp8Export) -> dict[str, Any]:
    """The `quantization_config` entry of `config.json` for `spec`."""
    skip = modules_to_not_convert(config)
    if spec.scheme == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [spec.block, spec.block], "modules_to_not_convert": skip}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
    static = spec.input_amax is not None
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized",
            "weights": {**fp8, "dynamic": False},
            "input_activations": {**fp8, "dynamic": not static},
            "output_activations": None}},
        "ignore": skip, "kv_cache_scheme": None,
    }


def export_fp8_tensors(config: ModelConfig, read: Read, spec: Fp8Export,
                       dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` of the FP8 export, in file order: `export_tensors`' tensors with every
    quantizable linear's weight in e4m3 followed by its scale (and input scale), the rest cast
    to `dtype`. Works on meta tensors (names, shapes and dtypes only)."""
    check_fp8_exportable(config, spec)
    for name, targets in tensor_pairs(config):
        tensor = read(name)
        if not hf_quantizable(name):
            for hf_name, part in hf_parts(config, name, tensor, targets):
                yield hf_name, part.to(dtype)
            continue
        for hf_name, part, amax in _parts_with_amax(config, name, tensor, targets, spec):
            q, scale = quantize(part, amax=amax, block=spec.block_shape)
            module = _module(hf_name)
            yield hf_name, q
            if spec.block_shape is not None:
                yield f"{module}.weight_scale_inv", scale.reciprocal()
                continue
            yield f"{module}.weight_scale", scale.reciprocal().reshape(1)
            if spec.input_amax is not None:
                yield f"{module}.input_scale", input_scale(spec.input_amax[name], tensor.device)


def _parts_with_amax(config: ModelConfig, name: str, tensor: torch.Tensor,
                     targets: list[tuple[str, bool]], spec: Fp8Export
                     ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """`hf_parts` with the amax each part is quantized against: None per block (each block's
    own); per tensor the fused tensor's, so q/k/v (gate/up) share a scale, and for grouped
    experts `(E, out, in)` each expert's, so one expert's gate and up share one."""
    parts = hf_parts(config, name, tensor, targets)
    if spec.block_shape is not None:
        yield from ((hf_name, part, None) for hf_name, part in parts)
        return
    if tensor.dim() != 3:
        amax = weight_amax(tensor)
        yield from ((hf_name, part, amax) for hf_name, part in parts)
        return
    per_expert = len(targets) // tensor.shape[0]
    amaxes = tensor.abs().amax(dim=(1, 2)).float()
    for i, (hf_name, part) in enumerate(parts):
        yield hf_name, part, amaxes[i // per_expert]


def input_scale(amax: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The static activation scale (a multiplier, shape `(1,)`) of an input amax."""
    return torch.tensor([amax / E4M3_MAX if amax > 0 else 1.0], dtype=torch.float32,
                        device=device)


# ------------------------------------------------------------------------------- import


def _fp8_block(qc: dict[str, Any]) -> Block | None:
    """The block shape of an FP8 `quantization_config`, None per tensor/channel.

    Raises:
        ConversionError: a quantization method or scheme this importer does not read.
    """
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        return None if block is None else (int(block[0]), int(block[1]))
    if method == "compressed-tensors":
        if qc.get("format") not in ("float-quantized", "naive-quantized"):
            raise ConversionError(f"compressed-tensors format {qc.get('format')!r} is not an "
                                  "FP8 format this importer reads (float-quantized)")
        blocks = set()
        for group_name, group in (qc.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if (w.get("num_bits"), w.get("type")) != (8, "float"):
                raise ConversionError(f"compressed-tensors group {group_name}: weights "
                                      f"{w.get('num_bits')}-bit {w.get('type')} are not FP8")
            if w.get("strategy") == "block":
                blocks.add(tuple(w["block_structure"]))
            elif w.get("strategy") not in ("tensor", "channel"):
                raise ConversionError(f"compressed-tensors group {group_name}: weight strategy "
                                      f"{w.get('strategy')!r} is not supported")
        if len(blocks) > 1:
            raise ConversionError(f"compressed-tensors groups use several blocks {blocks}")
        return blocks.pop() if blocks else None
    raise ConversionError(f"quant_method {method!r} cannot be imported; supported: fp8 "
                          "(block or per tensor) and compressed-tensors float-quantized FP8")


def dequantize_hf(q: torch.Tensor, scale: torch.Tensor, block: Block | None) -> torch.Tensor:
    """fp32 `q * scale` as transformers and vLLM dequantize: `scale` per tensor (`()` or
    `(1,)`), per output channel (`(out, 1)`) or per `block` (`(ceil(out / bo), ceil(in / bi))`,
    ragged edge blocks cropped)."""
    q32, s = q.float(), scale.float()
    if s.numel() == 1:
        return q32 * s.reshape(())
    rows, cols = q.shape
    if s.shape == (rows, 1):
        return q32 * s
    if block is None:
        if rows % s.shape[0] or cols % s.shape[1]:
            raise ConversionError(f"a {tuple(s.shape)} scale grid does not divide a weight of "
                                  f"shape {tuple(q.shape)} and the config names no block size")
        block = (rows // s.shape[0], cols // s.shape[1])
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(s.shape) != want:
        raise ConversionError(f"a weight of shape {tuple(q.shape)} with {block[0]}x{block[1]} "
                              f"blocks needs a {want} scale, not {tuple(s.shape)}")
    return q32 * expand_blocks(s, block)[:rows, :cols]


def dequantizing_reader(hf_config: dict[str, Any], read: Read, names: set[str]
                        ) -> tuple[Read, set[str]]:
    """`(read, names)` over an HF directory's tensors with FP8 ones dequantized to fp32 and
    their scales hidden; unchanged when `hf_config` has no `quantization_config`."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return read, names
    block = _fp8_block(qc)
    scales: dict[str, str] = {}  # weight name -> its scale's name
    hidden = set()
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in _SCALE_NAMES:
            if f"{module}.weight" not in names:
                raise ConversionError(f"{name} has no weight {module}.weight")
            scales[f"{module}.weight"] = name
            hidden.add(name)
        elif leaf in _INPUT_SCALE_NAMES:  # activation scales: dequantized weights need none
            hidden.add(name)

    def dequantizing_read(name: str) -> torch.Tensor:
        tensor = read(name)
        if tensor.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise ConversionError(f"FP8 tensor {name} has no weight_scale(_inv)")
            return dequantize_hf(tensor, read(scales[name]), block)
        return tensor

    return dequantizing_read, names - hidden
