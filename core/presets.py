"""The model presets (`core.config.PRESETS`): a model from a preset plus written fields
(`model_from_spec`, for `tessera pretrain` and `tessera plan`), and the presets as a table, for
`tessera models` / `--list-models`.

The parameter count is the global model's (tied embeddings counted once), from the same shape
rules the sharding uses, so it matches what a checkpoint of the preset holds.
"""

from __future__ import annotations

from typing import Any

from tessera.core.config import PRESETS, ConfigError, ModelConfig
from tessera.core.field_values import coerce_field
from tessera.core.models.registry import registered
from tessera.core.units import human_count

DEFAULT_PRESET = "llama-demo"

COLUMNS = ("preset", "family", "params", "layers", "hidden", "heads", "kv heads", "ffn",
           "vocab", "context")


def model_from_spec(spec: Any, preset: str | None = None, overrides: list[str] | tuple = ()
                    ) -> tuple[ModelConfig, frozenset[str]]:
    """The model a run config describes, and the names of the fields it sets.

    `spec` is the YAML `model:` value (a preset name, a mapping of `ModelConfig` fields with an
    optional `preset` key, or None); `preset` (`--model`) replaces its preset name and
    `overrides` (`--model-overrides KEY=VALUE ...`, values read as YAML) its fields. A
    sub-config field is named `moe.top_k` / `options.binary_head`, given as a `moe:` /
    `options:` mapping, or by its flat name of older configs (`moe_top_k`, `binary_head`). A preset's
    own values are not "set": a caller may still fill them (the vocabulary follows the
    tokenizer). Raises `ConfigError` naming an unknown field or a value of the wrong type.
    """
    import yaml  # only when a model is described, not for `--help`

    fields: dict[str, Any] = {}
    name = DEFAULT_PRESET
    if isinstance(spec, str):
        name = spec
    elif isinstance(spec, dict):
        fields = dict(spec)
        name = fields.pop("preset", name)
    elif spec is not None:
        raise ConfigError(f"model: expected a preset name or a mapping of fields, got {spec!r}")
    if preset:
        name = preset
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--model-overrides expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        fields[key] = yaml.safe_load(value)
    for sub in ("moe", "options"):  # a YAML mapping `moe: {top_k: 2}` is `moe.top_k: 2`
        if isinstance(fields.get(sub), dict):
            fields.update({f"{sub}.{k}": v for k, v in fields.pop(sub).items()})
    family = fields.get("family") or PRESETS.get(name, {}).get("family", ModelConfig.family)
    types = ModelConfig.field_types(family)
    nested: dict[str, dict[str, Any]] = {}
    for key, value in fields.items():
        if key not in types:
            raise ConfigError(f"unknown model field {key!r} for a family {family!r} model; the "
                              f"fields are {', '.join(sorted(types))}")
        fields[key] = coerce_field(f"model.{key}", value, types[key])
        sub, _, name_in_sub = key.partition(".")
        if name_in_sub:
            nested.setdefault(sub, {})[name_in_sub] = fields[key]
    flat = {k: v for k, v in fields.items() if "." not in k}
    return ModelConfig.from_name(name, **flat, **nested), frozenset(fields)


def preset_rows() -> list[tuple[str, ...]]:
    """One row per preset name, in `PRESETS` order; an alias names the preset it repeats."""
    from tessera.core.parallel.sharding import num_parameters  # torch: only when listing

    rows, seen = [], {}
    for name, fields in PRESETS.items():
        c = ModelConfig.from_name(name)
        label = f"{name} (= {seen[id(fields)]})" if id(fields) in seen else name
        seen.setdefault(id(fields), name)
        rows.append((label, c.family, human_count(num_parameters(c), digits=1), str(c.num_layers),
                     str(c.hidden_size), str(c.num_heads), str(c.num_kv_heads),
                     str(c.ffn_hidden_size), str(c.vocab_size), str(c.max_position_embeddings)))
    return rows


def presets_table() -> str:
    """Every preset with its sizes, as aligned text columns under a header, then the
    families."""
    rows = [COLUMNS, *preset_rows()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    families = ", ".join(registered())
    return "\n".join(lines) + (f"\n\nFamilies: {families}.\nUse one with --model NAME; change "
                               "any field with --model-overrides KEY=VALUE.")


def main(argv: list[str]) -> int:
    """`tessera models`: print the presets table."""
    import argparse

    argparse.ArgumentParser(prog="tessera models", description="List the model presets with "
                            "their sizes (also `tessera pretrain --list-models`).").parse_args(argv)
    print(presets_table())
    return 0
