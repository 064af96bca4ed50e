"""`tessera tune`: train prompts, or evaluate / export / import a prompt table.

    tessera tune --checkpoint BASE --data train.jsonl [--valid valid.jsonl] \\
        --method prompt-tuning|p-tuning --virtual-tokens N [--encoder mlp|lstm] --output DIR
    tessera tune --evaluate --prompts DIR --data x.jsonl [--checkpoint BASE]
    tessera tune --export peft --prompts DIR --output OUT [--task NAME]
    tessera tune --import-peft ADAPTER_DIR --checkpoint BASE --task NAME --output DIR
    tessera tune --checkpoint BASE --data train.jsonl --method lora --lora-rank R \\
        --lora-alpha A --lora-targets qkv,wo --output DIR      (adapter: DIR/adapter)
    tessera tune --evaluate --adapter DIR/adapter --data x.jsonl [--checkpoint BASE]
    tessera tune --merge ADAPTER_DIR [--checkpoint BASE] --output OUT [--tp T --pp P]
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main(argv: list[str], engine_answers: Any = None) -> int:
    """`engine_answers(model, tokenizer, prompts, max_tokens)`: serving's greedy answers, for
    `--eval-engine` (the root command passes them; tuning may not import serving)."""
    from tessera.core.config import ConfigError
    from tessera.tuning.config import load_config

    try:
        cfg, args = load_config(argv)  # `--help` exits here, before torch is imported
    except (ConfigError, FileNotFoundError, FileExistsError, PermissionError) as exc:
        print(f"tessera tune: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from tessera.core.checkpoint import CheckpointError
    from tessera.core.lora_format import AdapterError
    from tessera.core.prompt_table import PromptTableError
    from tessera.training.run_dir import missing_directories, remove_empty_directories
    from tessera.training.watchdog import RankHang
    from tessera.tuning.checkpoint import TuningCheckpointError

    joined = dist.is_initialized()  # a caller's process group is the caller's to destroy
    created = missing_directories(cfg.loop.output)  # taken back if the run is refused
    try:
        if args.import_peft:
            return _import(cfg, args, argv)
        if args.export and args.prompts:
            from tessera.tuning.peft_format import export_peft

            dirs = export_peft(args.prompts, cfg.loop.output, task=args.task)
            print("PEFT adapters: " + ", ".join(str(d) for d in dirs))
            return 0
        if args.export and cfg.tune.method == "lora":
            raise ConfigError("--export peft writes prompt tables; a LoRA adapter converts with "
                              "`tessera convert --to peft --input OUTPUT/adapter --checkpoint "
                              "BASE --output DIR`")
        if args.nproc_per_node and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tessera.core.parallel.launch import launch_local_ranks
            from tessera.tuning.loop import prepare_inputs

            if not (args.evaluate or args.merge):
                prepare_inputs(cfg, train=cfg.tune.data, valid=cfg.tune.valid)  # fail early
            return launch_local_ranks("tune", argv, args.nproc_per_node, args.max_restarts)
        if args.merge:
            from tessera.tuning.lora_merge import merge_adapter

            out = merge_adapter(cfg, args.merge, output_given=_given_output(argv))
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"merged checkpoint: {out}")
            return 0
        if args.evaluate and args.adapter:
            from tessera.tuning.loop import evaluate_adapter

            evaluate_adapter(cfg, args.adapter)
            return 0
        if args.evaluate:
            from tessera.tuning.loop import evaluate_table

            if not args.prompts:
                raise ConfigError("--evaluate needs --prompts DIR (a prompt table) or --adapter "
                                  "DIR (a LoRA adapter)")
            evaluate_table(cfg, args.prompts)
            return 0
        if cfg.tune.method == "dpo":
            from tessera.tuning.dpo_loop import tune_dpo

            print(f"tessera tune: {tune_dpo(cfg)['result']}")
            return 0
        from tessera.tuning.loop import tune

        tune(cfg, export_peft=args.export == "peft", engine_answers=engine_answers)
    except RankHang as exc:
        # Straight out: destroying a process group whose peer stopped answering can block.
        print(f"tessera tune: {exc}", file=sys.stderr, flush=True)
        os._exit(exc.exit_code)
    except (ConfigError, CheckpointError, PromptTableError, AdapterError, TuningCheckpointError,
            FileNotFoundError, FileExistsError, PermissionError) as exc:
        remove_empty_directories(created)
        print(f"tessera tune: {exc}", file=sys.stderr)
        return 2
    finally:
        if not joined and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _import(cfg, args, argv: list[str]) -> int:
    from tessera.core.config import ConfigError
    from tessera.tuning.peft_format import import_peft

    given_output = _given_output(argv)
    missing = [flag for flag, value in (("--checkpoint", cfg.tune.checkpoint),
                                        ("--task", args.task), ("--output", given_output))
               if not value]
    if missing:
        raise ConfigError(f"--import-peft needs {', '.join(missing)}")
    out = import_peft(args.import_peft, cfg.tune.checkpoint, args.task, cfg.loop.output,
                      add_eos=cfg.tune.add_eos)
    print(f"prompt table for task {args.task!r}: {out}")
    return 0


def _given_output(argv: list[str]) -> bool:
    """Whether --output was given (its default suits a tuning run, not a written artifact)."""
    return any(a.split("=")[0] in ("--output", "--loop.output") for a in argv)
