"""`tessera pretrain`: parse the config, hand over to torchrun when asked, run the loop.

With no arguments it runs the built-in demo (see `training.demo`). `--help` and
`--list-models` import no torch: everything heavy is imported once the config parses.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from tessera.core.config import ConfigError
    from tessera.training.config import load_config

    try:
        cfg, args = load_config(argv)
    except ConfigError as exc:
        print(f"tessera pretrain: {exc}", file=sys.stderr)
        return 2
    if args.list_models:
        from tessera.core.presets import presets_table

        print(presets_table())
        return 0
    import torch.distributed as dist

    from tessera.core.checkpoint import CheckpointError
    from tessera.training.run_dir import missing_directories, remove_empty_directories
    from tessera.training.watchdog import RankHang

    demo = args.demo or not cfg.data.data
    explicit = set(_given_flags(argv))
    joined = dist.is_initialized()  # a caller's process group is the caller's to destroy
    # The output directories this run would create: taken back if it is refused. (The demo's
    # default output is set later; the demo checks its config before making it.)
    created = missing_directories(cfg.loop.output)
    try:
        if args.nproc_per_node and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tessera.core.parallel.launch import launch_local_ranks
            from tessera.training.demo import demo_config, demo_fills_pipeline
            from tessera.training.run_plan import resolve_plan

            # Before starting any rank: the plan for that world must resolve.
            resolve_plan(demo_config(cfg, explicit) if demo else cfg, args.nproc_per_node,
                         fill_pipeline=demo and demo_fills_pipeline(explicit))
            return launch_local_ranks("pretrain", argv, args.nproc_per_node, args.max_restarts)
        if demo:
            from tessera.training.demo import run_demo

            run_demo(cfg, explicit)
        else:
            from tessera.training.loop import pretrain

            # Stopped by a signal (after saving): 130 for SIGINT, 143 for SIGTERM, so a
            # scheduler sees the run as interrupted and can requeue it with --resume.
            signum = pretrain(cfg).get("stop_signal", 0)
            if signum:
                return 128 + signum
    except RankHang as exc:
        # Straight out: destroying a process group whose peer stopped answering can block.
        print(f"tessera pretrain: {exc}", file=sys.stderr, flush=True)
        os._exit(exc.exit_code)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError, PermissionError) as exc:
        remove_empty_directories(created)
        print(f"tessera pretrain: {exc}", file=sys.stderr)
        return 2
    finally:
        # Left to interpreter exit, gloo's threads can abort the process ("terminate called
        # without an active exception"), and torchrun then reports the rank as failed.
        if not joined and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _given_flags(argv: list[str]) -> list[str]:
    return [a.lstrip("-").split("=")[0].split(".")[-1].replace("-", "_") for a in argv if a.startswith("--")]
