"""`tessera pretrain`: parse the config, hand over to torchrun when asked, run the loop.

With no arguments it runs the built-in demo (see `training.demo`).
"""

from __future__ import annotations

import copy
import os
import sys

import torch.distributed as dist

from tessera.core.checkpoint import CheckpointError
from tessera.core.config import ConfigError


def main(argv: list[str]) -> int:
    from tessera.training.config import load_config

    try:
        cfg, args = load_config(argv)
    except ConfigError as exc:
        print(f"tessera pretrain: {exc}", file=sys.stderr)
        return 2
    demo = args.demo or not cfg.data.data
    explicit = set(_given_flags(argv))
    joined = dist.is_initialized()  # a caller's process group is the caller's to destroy
    try:
        if args.nproc_per_node and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tessera.training.demo import apply_demo_defaults
            from tessera.training.loop import check_config

            checked = copy.deepcopy(cfg)
            if demo:
                apply_demo_defaults(checked, explicit)
            check_config(checked, args.nproc_per_node)  # before starting any rank
            return launch_ranks(argv, args.nproc_per_node)
        if demo:
            from tessera.training.demo import run_demo

            run_demo(cfg, explicit)
        else:
            from tessera.training.loop import pretrain

            pretrain(cfg)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError, PermissionError) as exc:
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


def launch_ranks(argv: list[str], nproc: int, verb: str = "pretrain") -> int:
    """Re-run `tessera VERB ARGV` under torch's own launcher with `nproc` local ranks."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        rest.append(a)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "tessera", verb, *rest])
    except ChildFailedError as exc:  # the ranks have printed their own errors
        rank, failure = exc.get_first_failure()
        print(f"tessera {verb}: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
