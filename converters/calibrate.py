"""Activation calibration for static FP8 input scales: `calibrate_input_amax`.

The checkpoint's model runs in fp32 (one process, any saved layout) over sample text, and every
quantizable linear (`weight_format.quantizable`: wqkv, wo, w1, w2 of each block) records the
largest absolute value its input takes. `input_scale = amax / 448` (`hf_fp8.input_scale`) is
then the multiplier vLLM's static FP8 activations use. Fused layers have one input, so q/k/v
(and gate/up) get one input scale, as vLLM wants for the layers it fuses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.converters.hf_mapping import ConversionError
from tessera.core.checkpoint import load_checkpoint, read_manifest
from tessera.core.parallel.layers import quantizable_linears
from tessera.core.tokenizer import load_tokenizer

MAX_WINDOW = 2048  # tokens per forward pass, at most (and at most the model's context)
DEFAULT_MAX_TOKENS = 1 << 16


@torch.no_grad()
def calibrate_input_amax(ckpt_dir: str | Path, text_file: str | Path,
                         max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, float]:
    """Tessera weight name of every quantizable linear -> the amax of its input over the first
    `max_tokens` tokens of `text_file`, encoded with the checkpoint's tokenizer.

    Raises:
        ConversionError: the file is missing or holds no text, or the checkpoint has no tokenizer.
    """
    ckpt_dir, text_file = Path(ckpt_dir), Path(text_file)
    if not text_file.is_file():
        raise ConversionError(f"calibration data {text_file} does not exist")
    text = text_file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ConversionError(f"calibration data {text_file} is empty; give it sample text "
                              "like the model will see (a few thousand tokens)")
    manifest = read_manifest(ckpt_dir)
    if not manifest.tokenizer:
        raise ConversionError(f"{ckpt_dir} has no tokenizer, so the calibration text cannot be "
                              "encoded; export without --calibration-data (dynamic activations)")
    ids = load_tokenizer(ckpt_dir / manifest.tokenizer).encode(text)[:max_tokens]
    model = load_checkpoint(ckpt_dir, dtype=torch.float32)
    amax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen
        return hook

    handles = [layer.register_forward_pre_hook(record(f"{name}.weight"))
               for name, layer in quantizable_linears(model)]
    try:
        window = min(MAX_WINDOW, manifest.model.max_position_embeddings)
        for start in range(0, len(ids), window):
            model(torch.tensor([ids[start:start + window]]))
    finally:
        for handle in handles:
            handle.remove()
    return {name: value.item() for name, value in amax.items()}
