"""`tessera pretrain`: parse the config, hand over to torchrun when asked, run the loop.

With no arguments it runs the built-in demo (see `training.demo`).
"""

from __future__ import annotations

import os
import sys

from tessera.core.config import ConfigError


def main(argv: list[str]) -> int:
    from tessera.training.config import load_config

    try:
        cfg, args = load_config(argv)
    except ConfigError as exc:
        print(f"tessera pretrain: {exc}", file=sys.stderr)
        return 2
    if args.nproc_per_node and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _launch(argv, args.nproc_per_node)
    demo = args.demo or not cfg.data.data
    try:
        if demo:
            from tessera.training.demo import run_demo

            run_demo(cfg, explicit=set(_given_flags(argv)))
        else:
            from tessera.training.loop import pretrain

            pretrain(cfg)
    except (ConfigError, FileNotFoundError, FileExistsError, PermissionError) as exc:
        print(f"tessera pretrain: {exc}", file=sys.stderr)
        return 2
    return 0


def _given_flags(argv: list[str]) -> list[str]:
    return [a.lstrip("-").split("=")[0].split(".")[-1].replace("-", "_") for a in argv if a.startswith("--")]


def _launch(argv: list[str], nproc: int) -> int:
    """Re-run this command under torch's own launcher with `nproc` local ranks."""
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
    torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "tessera", "pretrain", *rest])
    return 0
