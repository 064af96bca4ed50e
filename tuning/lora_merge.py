"""`tessera tune --merge ADAPTER --checkpoint BASE --output DIR`: a full checkpoint with a LoRA
adapter folded into its weights, `W + (alpha / rank) B A` for every adapted module.

Each rank of the output layout (`--tp`, `--pp`; run with `--nproc-per-node tp*pp`) loads its
shard of the base, attaches its pieces of the adapter (the sharding rule cuts B by rows on a
column-parallel base and A by columns on a row-parallel one, so `W_r + s B_r A` and
`W_r + s B A_r` are exactly its shards of the merged weight), merges in fp32, casts back to the
base's dtype and joins `core.checkpoint.save_checkpoint`, the one writer, which publishes the
directory atomically. Everything that can be refused (an adapter for another base, an FP8
base, an existing output) is refused before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tessera.core.checkpoint import dtype_from_name, load_weights, read_manifest, save_checkpoint
from tessera.core.config import ConfigError
from tessera.core.fingerprint import base_fingerprint
from tessera.core.lora import attach_lora, merge_lora_
from tessera.core.lora_format import check_base, load_adapter
from tessera.training.loop import build_rank_model, plan_for_world
from tessera.tuning.config import TuneRunConfig


def merge_adapter(cfg: TuneRunConfig, adapter_dir: str, *, output_given: bool = True) -> Path:
    """Write `cfg.loop.output` as `cfg.tune.checkpoint` (default: the adapter's base) with the
    adapter at `adapter_dir` merged, in the layout of `cfg.parallel`. Collective."""
    config, tensors = load_adapter(adapter_dir)
    base = cfg.tune.checkpoint or config.base_checkpoint
    if not base:
        raise ConfigError("--merge needs --checkpoint BASE (the adapter names no base)")
    if not output_given:
        raise ConfigError("--merge needs --output DIR (where the merged checkpoint goes)")
    manifest = read_manifest(base)
    if manifest.fp8:
        raise ConfigError(f"{base} is an FP8 checkpoint; merge into its higher-precision "
                          "original, then convert the result to FP8")
    check_base(config, base_fingerprint(base), base)
    output = Path(cfg.loop.output)
    if output.exists() and not cfg.loop.overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    # No step runs, but the layout is checked as a training one (`weights_only`).
    plan, device = plan_for_world(cfg, model=manifest.model, weights_only=True)
    _, stages = build_rank_model(plan, device, init=False)
    load_weights(stages, base)
    attach_lora(stages, config, tensors=tensors)
    merge_lora_(stages)
    dtype = dtype_from_name(manifest.dtype)
    for m in stages:
        m.to(dtype)
    extra = {**manifest.extra, "merged_adapter": {
        "path": str(Path(adapter_dir).resolve()), "rank": config.rank, "alpha": config.alpha,
        "modules": list(config.modules)}}
    tokenizer = Path(base) / manifest.tokenizer if manifest.tokenizer else None
    path = save_checkpoint(output, stages, step=manifest.step, tokenizer=tokenizer, extra=extra)
    if dist.is_initialized():
        dist.barrier()
    return path
