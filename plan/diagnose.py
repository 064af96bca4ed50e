"""Why no configuration is valid for a job with fixed dimensions, and which values would be.

When the fixed dimensions (`search.Fixed`) leave no configuration that passes the divisibility
rules, `tessera plan` says, for each fixed dimension, what its value breaks (the rules of
`search.config_problems`, e.g. "tp 3 must divide the 8 GPUs of a node") and which values of it
are valid with the other fixed dimensions as they are: releasing one dimension at a time and
enumerating what `search._configs` then yields.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from tessera.plan import estimate as E
from tessera.plan import search as S

# Fields of `Fixed` that are also `estimate.Config` fields (sharded_optimizer included).
_CONFIG_FIELDS = {f.name for f in fields(E.Config)}


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "all" if value is None else str(value)


def _problems_with(job: S.TrainingJob, valid: E.Config, name: str, value: Any) -> list[str]:
    """What breaks when the valid configuration `valid` takes `name` = `value` (dp follows
    from the GPUs when tp, pp or cp change; when their product does not divide the GPUs that
    is said once, not as the GPU-count and batch mismatches of a made-up dp)."""
    c = replace(valid, **{name: value})
    head = []
    if name in ("tp", "pp", "cp"):
        n = c.tp * c.pp * c.cp
        c = replace(c, dp=max(1, job.gpus // n))
        if job.gpus % n:
            head = [f"tp {c.tp} x pp {c.pp} x cp {c.cp} = {n} does not divide the {job.gpus} "
                    "GPUs"]
    try:
        problems = S.config_problems(job, c)
    except ValueError as exc:  # a layout the core refuses to build at all
        problems = [str(exc)]
    if head:
        problems = [p for p in problems if f"not the {job.gpus} GPUs" not in p
                    and "is not divisible by dp" not in p]
    return head + problems


def fixed_alternatives(job: S.TrainingJob, fixed: S.Fixed) -> list[str]:
    """One line per fixed dimension that no valid configuration has with the others as fixed:
    `name=value: what it breaks; valid here: v1, v2, ...`. When no single dimension is at
    fault, one line with what the fixed values break together; empty when nothing is fixed
    (then the GPU count or the batch is at fault)."""
    lines = []
    for f in fields(fixed):
        value = getattr(fixed, f.name)
        if value is None or f.name not in _CONFIG_FIELDS:
            continue
        released = replace(fixed, **{f.name: None})
        if f.name == "recompute" and fixed.recompute_layers is not None:
            continue  # recompute_layers needs recompute full; the layers line covers it
        valid = list(S._configs(job, released))
        values = sorted({getattr(c, f.name) for c in valid}, key=lambda v: (str(type(v)), v))
        if not valid or value in values:
            continue
        why = _problems_with(job, valid[0], f.name, value)
        lines.append(f"{f.name}={_value_text(value)}: "
                     + ("; ".join(why) if why else "breaks a rule with the other dimensions")
                     + f". Valid here: {', '.join(_value_text(v) for v in values)}")
    if lines:
        return lines
    # No one dimension frees the others: say what the fixed values break together, on the
    # configuration they give with every other dimension at its default.
    given = {f.name: getattr(fixed, f.name) for f in fields(fixed)
             if getattr(fixed, f.name) is not None and f.name in _CONFIG_FIELDS}
    if not given:
        return []
    base = S._config_of({}, job)
    name, value = next(iter(given.items()))
    together = _problems_with(job, replace(base, **{k: v for k, v in given.items()
                                                   if k != name}), name, value)
    text = ", ".join(f"{k}={_value_text(v)}" for k, v in given.items())
    return [f"{text} together (every other dimension at 1 / off): " + "; ".join(together)
            + ". Change more than one of them"] if together else []
