"""The model presets (`core.config.PRESETS`) as a table, for `tessera models` / `--list-models`.

The parameter count is the global model's (tied embeddings counted once), from the same shape
rules the sharding uses, so it matches what a checkpoint of the preset holds.
"""

from __future__ import annotations

from tessera.core.config import PRESETS, ModelConfig
from tessera.core.units import human_count

COLUMNS = ("preset", "family", "params", "layers", "hidden", "heads", "kv heads", "ffn",
           "vocab", "context")


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
    """Every preset with its sizes, as aligned text columns under a header."""
    rows = [COLUMNS, *preset_rows()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + ("\n\nUse one with --model NAME; change any field with "
                               "--model-overrides KEY=VALUE.")


def main(argv: list[str]) -> int:
    """`tessera models`: print the presets table."""
    import argparse

    argparse.ArgumentParser(prog="tessera models", description="List the model presets with "
                            "their sizes (also `tessera pretrain --list-models`).").parse_args(argv)
    print(presets_table())
    return 0
