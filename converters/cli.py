"""`tessera convert`: Hugging Face import/export, resharding to any layout, dtype casts, FP8,
and LoRA adapters to and from Hugging Face `peft`.

The parser has four groups: input/output (shared by every conversion), the Hugging Face
direction (`--from hf|peft` / `--to hf|peft`), LoRA adapters (`--checkpoint`, the base a
`peft` conversion needs, and `--hf-model`), and the target layout (`--tp --pp --virtual-stages
--fp8`). The PEFT conversions live here, beside the HF model conversion whose module names they
follow (`converters/peft_lora.py`), not under `tessera tune`: tuning may not be imported by
converters, and an adapter is converted for the HF export of its base. A Tessera-to-Tessera
conversion (any layout flag, or `--dtype` alone) goes to `converters/reshard.py`;
`--to hf --fp8 block|tensor` writes the FP8 forms vLLM and transformers load
(`converters/hf_fp8.py`). Exit codes: 0 done, 1 the conversion failed (the message says why),
2 a usage error.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tessera.core.arg_types import positive_int
from tessera.core.help import HelpFormatter

# The conversions (and torch) are imported when they run, so `--help` is instant.

EXAMPLES = """\
examples:
  tessera convert --from hf --input ./TinyLlama-1.1B --output ckpt/tinyllama --dtype bf16
  tessera convert --to hf --input ckpt/tinyllama --output ./tinyllama-hf
  tessera convert --to hf --input ckpt/gpt2-small --output ./gpt2-hf --shard-size 200MB
  tessera convert --input runs/x/checkpoints/step-00001000 --output ckpt/tp2 --tp 2
  tessera convert --input ckpt/tp8pp4 --output ckpt/serve-fp8 --tp 1 --pp 1 --fp8
  tessera convert --to hf --fp8 block --input ckpt/llama --output ./llama-fp8
  tessera convert --to hf --fp8 tensor --calibration-data text.txt --input ckpt/a --output ./a-fp8
  tessera convert --input ckpt/a --output ckpt/a-bf16 --dtype bf16
  tessera convert --input ckpt/mixtral --output ckpt/mixtral-ep4 --ep 4 --etp 2 --tp 2 --dp 4
  tessera convert --to peft --input runs/lora/adapter --checkpoint BASE --output peft-lora
  tessera convert --from peft --input peft-lora --checkpoint BASE --output adapters/imported

Hugging Face model types: gpt2, llama, mistral (with its sliding window), qwen2, nemotron and
more (docs/hf-models.md). A LoRA adapter converts for the Hugging
Face export of its base (`--to hf` of the same --checkpoint). Output directories are written
atomically and an existing one is replaced only with --overwrite.
"""

LAYOUT_FLAGS = ("tp", "pp", "virtual_stages", "placement", "fp8", "ep", "etp", "dp")
DEFAULT_FP8_BLOCK = 128  # converters.hf_fp8.DEFAULT_BLOCK, the DeepSeek-V3 / Qwen3-FP8 block
DEFAULT_SHARD_SIZE = "5GB"  # transformers' own default (converters.hf_io.DEFAULT_SHARD_SIZE)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number (decimal units, as transformers)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 1048576)")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera convert",
        description="Convert checkpoints: import a Hugging Face model into a Tessera checkpoint, "
        "or export a Tessera checkpoint as a Hugging Face model directory; convert LoRA "
        "adapters to and from Hugging Face peft.",
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", required=True, type=Path, metavar="DIR",
                    help="the directory to convert (HF model dir, Tessera checkpoint, or LoRA "
                    "adapter)")
    io.add_argument("--output", required=True, type=Path, metavar="DIR",
                    help="the directory to write (written atomically)")
    io.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                    help="cast every tensor (default: keep the input's dtype)")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    hf = parser.add_argument_group("Hugging Face")
    direction = hf.add_mutually_exclusive_group()
    direction.add_argument("--from", dest="from_format", choices=("hf", "peft"),
                           help="--input is a Hugging Face model directory (hf) or a peft LoRA "
                           "adapter directory (peft, written as a Tessera adapter for --checkpoint)")
    direction.add_argument("--to", dest="to_format", choices=("hf", "peft"),
                           help="write --output as a Hugging Face model directory (hf) or, for a "
                           "Tessera LoRA adapter --input, as a peft LoRA adapter (peft)")
    hf.add_argument("--shard-size", type=parse_size, default=parse_size(DEFAULT_SHARD_SIZE),
                    metavar="SIZE",
                    help=f"with --to hf: largest weights file, e.g. 2GB (default: {DEFAULT_SHARD_SIZE})")
    lora = parser.add_argument_group("LoRA adapters (--from peft / --to peft)")
    lora.add_argument("--checkpoint", type=Path, metavar="DIR",
                      help="the Tessera base checkpoint the adapter belongs to (required)")
    lora.add_argument("--hf-model", metavar="NAME",
                      help="with --to peft: base_model_name_or_path for the adapter, the path "
                      "or hub id of the HF export of --checkpoint (default: unset)")
    layout = parser.add_argument_group("target layout (resharding and FP8)")
    layout.add_argument("--tp", type=positive_int, metavar="N",
                        help="tensor-parallel size (default: the input's)")
    layout.add_argument("--pp", type=positive_int, metavar="N",
                        help="pipeline-parallel size (default: the input's)")
    layout.add_argument("--virtual-stages", type=positive_int, metavar="N",
                        help="model chunks per pipeline rank (default: the input's)")
    layout.add_argument("--placement", choices=("looped", "v"),
                        help="how stages sit on pipeline ranks: looped (1F1B, interleaved) or v "
                        "(two per rank, for the zbv / dualpipev schedules) (default: the "
                        "input's while pp is unchanged, else looped)")
    # Mixture-of-Experts: the expert grid (converters/expert_reshard.py).
    layout.add_argument("--ep", type=positive_int, metavar="N",
                        help="expert-parallel size of a Mixture-of-Experts target: the expert "
                        "banks are written in the ep x etp pieces a training run of that "
                        "layout saves (default 1: whole banks, which load under any ep)")
    layout.add_argument("--etp", type=positive_int, metavar="N",
                        help="expert-tensor-parallel size: each expert's FFN split over etp "
                        "ranks (default 1)")
    layout.add_argument("--dp", type=positive_int, metavar="N",
                        help="with --ep/--etp: data-parallel size of the run the target is "
                        "for; ep x etp folds over tp x cp x dp and ep must divide dp x cp "
                        "(default: the input's)")
    layout.add_argument("--fp8", nargs="?", const="tensor", choices=("tensor", "channel", "block"),
                        help="store linear weights as FP8 e4m3 with per-tensor (default) or "
                        "per-channel scales; with --to hf: block (quant_method fp8, 128x128 "
                        "blocks, dynamic activations) or tensor (compressed-tensors FP8), "
                        "the formats vLLM, SGLang and transformers load")
    layout.add_argument("--fp8-block", type=positive_int, default=None, metavar="N",
                        help=f"with --to hf --fp8 block: rows and columns per scale (default: "
                        f"{DEFAULT_FP8_BLOCK}); it must divide every linear layer's dimensions")
    layout.add_argument("--calibration-data", type=Path, metavar="FILE",
                        help="with --to hf --fp8 tensor: text to run the model over for static "
                        "input scales (default: dynamic activations)")
    return parser


def _convert_layout(args: argparse.Namespace) -> int:
    """Tessera -> Tessera: reshard, cast, and/or quantize to FP8 (streaming, atomic)."""
    from tessera.converters.reshard import reshard_checkpoint

    if args.from_format or args.to_format:
        print("tessera convert: error: --tp/--pp/--virtual-stages/--placement/--fp8 rewrite a Tessera "
              "checkpoint; import or export with --from/--to hf first, then convert",
              file=sys.stderr)
        return 2
    if args.fp8 == "block":
        print("tessera convert: error: --fp8 block is a Hugging Face format (add --to hf); "
              "Tessera checkpoints take --fp8 tensor or --fp8 channel", file=sys.stderr)
        return 2
    try:
        summary = reshard_checkpoint(
            args.input, args.output, tp=args.tp, pp=args.pp,
            virtual_stages=args.virtual_stages, placement=args.placement, dtype=args.dtype,
            fp8=args.fp8 is not None, fp8_per_channel=args.fp8 == "channel",
            overwrite=args.overwrite, ep=args.ep, etp=args.etp, dp=args.dp)
    except (OSError, ValueError) as exc:  # CheckpointError, ConfigError, ...
        print(f"tessera convert: error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0


def _export_hf_fp8(args: argparse.Namespace) -> int:
    """Tessera -> Hugging Face with FP8 linear layers (converters.hf_fp8)."""
    from tessera.converters.hf_fp8 import Fp8Export, check_fp8_exportable
    from tessera.converters.hf_io import export_hf
    from tessera.core.checkpoint import read_manifest
    from tessera.core.parallel.sharding import global_param_shapes
    from tessera.core.parallel.weight_format import quantizable

    if args.fp8 == "channel" or any(getattr(args, f) is not None for f in LAYOUT_FLAGS if f != "fp8"):
        print("tessera convert: error: --to hf takes --fp8 block or --fp8 tensor (no channel "
              "scales, no --tp/--pp: the HF directory is one model)", file=sys.stderr)
        return 2
    if args.fp8_block is not None and args.fp8 != "block":
        print("tessera convert: error: --fp8-block sizes the scale blocks of --fp8 block; "
              "--fp8 tensor has one scale per tensor", file=sys.stderr)
        return 2
    if args.calibration_data and args.fp8 != "tensor":
        print("tessera convert: error: --calibration-data makes static input scales, which "
              "only --fp8 tensor has (block FP8 activations are dynamic)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        spec = Fp8Export(args.fp8, block=args.fp8_block or DEFAULT_FP8_BLOCK)
        config = read_manifest(args.input).model
        check_fp8_exportable(config, spec)  # before a possibly long calibration
        if args.calibration_data:  # ... which records the inputs of the `quantizable` linears
            check_fp8_exportable(config, Fp8Export("tensor", input_amax=dict.fromkeys(
                filter(quantizable, global_param_shapes(config)), 0.0)))
            from tessera.converters.calibrate import calibrate_input_amax

            spec = Fp8Export("tensor", input_amax=calibrate_input_amax(
                args.input, args.calibration_data))
        out = export_hf(args.input, args.output, shard_size_bytes=args.shard_size,
                        overwrite=args.overwrite, dtype=args.dtype, fp8=spec)
    except (OSError, ValueError) as exc:  # ConversionError, CheckpointError, ...
        print(f"tessera convert: error: {exc}", file=sys.stderr)
        return 1
    kind = (f"{spec.block}x{spec.block} blocks, dynamic activations" if spec.scheme == "block"
            else "per tensor, " + ("static" if spec.input_amax else "dynamic") + " activations")
    print(f"exported {args.input} -> {out}: FP8 e4m3 linears ({kind}), "
          f"{_bytes_written(out):,} bytes written in {time.perf_counter() - start:.1f} s")
    return 0


def _bytes_written(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _convert_peft(args: argparse.Namespace) -> int:
    """A LoRA adapter: Tessera -> peft (`--to peft`) or peft -> Tessera (`--from peft`)."""
    usage = None
    if args.checkpoint is None:
        usage = "--from/--to peft needs --checkpoint, the Tessera base checkpoint"
    elif args.dtype is not None or any(getattr(args, f) is not None for f in LAYOUT_FLAGS):
        usage = "--dtype and the layout flags do not apply to a LoRA adapter"
    elif args.hf_model is not None and args.to_format != "peft":
        usage = "--hf-model applies to --to peft only"
    if usage:
        print(f"tessera convert: error: {usage}", file=sys.stderr)
        return 2
    from tessera.converters.peft_lora import export_peft, import_peft

    try:
        if args.to_format == "peft":
            out = export_peft(args.input, args.checkpoint, args.output, hf_model=args.hf_model,
                              overwrite=args.overwrite)
        else:
            out = import_peft(args.input, args.checkpoint, args.output, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:  # PeftLoraError, AdapterError, CheckpointError, ...
        print(f"tessera convert: error: {exc}", file=sys.stderr)
        return 1
    what = "peft LoRA adapter" if args.to_format == "peft" else "Tessera LoRA adapter"
    print(f"wrote {what} {out} (base {args.checkpoint}), {_bytes_written(out):,} bytes")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "peft" in (args.from_format, args.to_format):
        return _convert_peft(args)
    if args.checkpoint is not None or args.hf_model is not None:
        print("tessera convert: error: --checkpoint and --hf-model belong to --from/--to peft",
              file=sys.stderr)
        return 2
    hf_fp8 = args.to_format == "hf" and args.fp8 is not None
    if (args.fp8_block is not None or args.calibration_data) and not hf_fp8:
        print("tessera convert: error: --fp8-block and --calibration-data go with --to hf --fp8",
              file=sys.stderr)
        return 2
    if hf_fp8:
        return _export_hf_fp8(args)
    cast_only = args.dtype is not None and not (args.from_format or args.to_format)
    if cast_only or any(getattr(args, flag) is not None for flag in LAYOUT_FLAGS):
        return _convert_layout(args)
    if not (args.from_format or args.to_format):
        parser.print_usage(sys.stderr)
        print("tessera convert: error: say what to convert: --from hf|peft or --to hf|peft",
              file=sys.stderr)
        return 2
    from tessera.converters.hf_io import export_hf, import_hf
    from tessera.core.checkpoint import read_manifest

    start = time.perf_counter()
    try:
        if args.from_format == "hf":
            out = import_hf(args.input, args.output, dtype=args.dtype, overwrite=args.overwrite)
            verb = "imported"
        else:
            out = export_hf(args.input, args.output, shard_size_bytes=args.shard_size,
                            overwrite=args.overwrite, dtype=args.dtype)
            verb = "exported"
        config = read_manifest(out if args.from_format else args.input).model
    except (OSError, ValueError) as exc:  # ConversionError, CheckpointError, ConfigError, ...
        print(f"tessera convert: error: {exc}", file=sys.stderr)
        return 1
    from tessera.core.parallel.sharding import num_parameters

    written = _bytes_written(out)
    print(f"{verb} {args.input} -> {out}: {num_parameters(config):,} parameters "
          f"({config.family}), {written:,} bytes written in "
          f"{time.perf_counter() - start:.1f} s")
    return 0
