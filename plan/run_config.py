"""A planned training configuration as the YAML that `tessera pretrain --config` runs as is.

The `parallel:` section is the candidate's own (`Candidate.parallel_fields()`: Layout and
TrainSchedule field names, micro-batches per step rather than the planner's micro-batch size).
Context and expert parallelism (cp, ep) are written only when the core's `Layout` has those
fields (it has both now, and `etp`, which the candidate writes when above 1); a plan needing a
field Layout lacks is refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tessera.core.config import ConfigError, Layout

# Precisions `tessera pretrain` trains in that the planner also plans for.
PRETRAIN_PRECISIONS = ("fp32", "bf16")


def parallel_section(fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` (a `parallel:` section) checked against what the core's Layout can express:
    cp / ep of 1 are dropped while Layout lacks them, above 1 they are a ConfigError."""
    known = {f.name for f in dataclasses.fields(Layout)}
    out = dict(fields)
    for key, name in (("cp", "context"), ("ep", "expert")):
        if key in known:
            out.setdefault(key, 1)
        elif int(out.pop(key, 1) or 1) > 1:
            raise ConfigError(
                f"this plan uses {key} {fields[key]}, but `tessera pretrain` has no {name} "
                f"parallelism yet, so no run config can express it; fix it with --{key} 1 and "
                "plan again")
    return out


def run_config(fields: Mapping[str, Any], *, model: str, model_fields: Mapping[str, Any],
               global_batch: int, seq_len: int, precision: str,
               tokens: float | None = None) -> dict[str, Any]:
    """The whole pretraining config (model, parallel, train) for one planned candidate, from
    its `parallel_fields()`.

    `model_fields` are the ModelConfig fields the user overrode (written under `model:` beside
    the preset); `tokens` sets the step count (tokens / (global_batch x seq_len), rounded up),
    else the config's own default stays.
    """
    if precision not in PRETRAIN_PRECISIONS:
        raise ConfigError(f"`tessera pretrain` does not train in {precision}; plan with "
                          f"--precision in {list(PRETRAIN_PRECISIONS)} to write a run config")
    train: dict[str, Any] = {"global_batch": global_batch, "seq_len": seq_len,
                             "precision": precision}
    if tokens:
        train["steps"] = math.ceil(tokens / (global_batch * seq_len))
    return {"model": {"preset": model, **dict(model_fields)},
            "parallel": parallel_section(fields), "train": train}


def write_run_config(path: Path, config: dict[str, Any], world_size: int, header: str = ""
                     ) -> None:
    """Write `config` as YAML to `path` after checking that `tessera pretrain` loads it and
    that the layout it describes trains on `world_size` ranks (ConfigError otherwise; nothing
    is written then). `header` becomes a comment block at the top."""
    from tessera.core.files import atomic_file
    from tessera.core.parallel.pipeline import validate_training
    from tessera.training.config import load_config

    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    text = comment + yaml.safe_dump(config, sort_keys=False)
    with atomic_file(path) as tmp:
        Path(tmp).write_text(text)
        cfg, _ = load_config(["--config", str(tmp)])
        validate_training(cfg.model, cfg.parallel.layout(), cfg.parallel.train_schedule(),
                          world_size=world_size, global_batch=cfg.train.global_batch,
                          seq_len=cfg.train.seq_len)
