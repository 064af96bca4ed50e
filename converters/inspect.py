"""`tessera inspect CKPT`: what a checkpoint holds, in plain words (or JSON with `--json`).

Reads only the manifest and the weight files' headers, never a tensor, so it is instant on any
size of model; it checks each file against the manifest and exits 1 naming every damaged file.
`--verify` also reads every file once and checks it against the sha256 recorded when it was
written (weights, optimizer state, tokenizer: every file of a training checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The checkpoint readers (and torch) are imported when they run, so `--help` is instant.


def describe(path: str | Path, verify: bool = False) -> dict[str, Any]:
    """The facts `inspect` prints, as plain JSON-able data (`verify`: with every file's bytes
    checked against its recorded sha256; `digests` is then "match", "none recorded" or
    "damaged")."""
    from tessera.core.checkpoint import read_manifest
    from tessera.core.checkpoint_digests import damaged_files
    from tessera.core.checkpoint_verify import verify_checkpoint
    from tessera.core.parallel.sharding import num_parameters

    path = Path(path)
    man = read_manifest(path)
    m = man.model
    files = sorted({f for fs in man.weight_map.values() for f in fs})
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    problems = [str(p) for p in verify_checkpoint(path, man)]
    digests = None
    if verify:
        damaged = damaged_files(path)
        digests = "none recorded" if damaged is None else "damaged" if damaged else "match"
        problems += [f"{file}: {problem}" for file, problem in damaged or []]
    return {
        "path": str(path),
        "family": m.family,
        "preset": m.name,
        "parameters": num_parameters(m),
        "layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads,
        "ffn_hidden_size": m.ffn_hidden_size,
        "vocab_size": m.vocab_size,
        "position": m.position,
        "tied_embeddings": m.tied_embeddings,
        "layout": {"tp": man.layout.tp, "pp": man.layout.pp,
                   "virtual_stages": man.layout.virtual_stages},
        "placement": man.layout.placement,  # looped | v (version-1 manifests: looped)
        "files": files,
        "missing_files": [f for f in files if not (path / f).is_file()],
        "dtype": man.dtype,
        "fp8": man.fp8,
        "size_bytes": size,
        "step": man.step,
        "tokenizer": man.tokenizer,
        "digests": digests,
        "problems": problems,
    }


def render(info: dict[str, Any]) -> str:
    """`describe`'s facts as a short aligned text block."""
    from tessera.core.units import human_bytes, human_count

    preset = f'preset "{info["preset"]}"' if info["preset"] != "custom" else "no preset (custom)"
    heads = f"{info['num_heads']} attention heads"
    if info["num_kv_heads"] != info["num_heads"]:
        heads += f" sharing {info['num_kv_heads']} key/value heads (grouped-query)"
    lay = info["layout"]
    vs = lay["virtual_stages"]
    files = f"{len(info['files'])} weight file{'s' if len(info['files']) != 1 else ''}, one per rank"
    if info["missing_files"]:
        files += f"; MISSING: {', '.join(info['missing_files'])}"
    fp8 = "no"
    if info["fp8"]:
        per = "one scale per output channel" if info["fp8"].get("granularity") == "channel" else (
            "one scale per tensor")
        fp8 = (f"{info['fp8'].get('format', 'e4m3')} linear-layer weights, {per}; embeddings, "
               f"output, norms and biases in {info['dtype']}")
    rows = [
        ("model", f"{info['family']} family, {preset}, {human_count(info['parameters'])} parameters"),
        ("shape", f"{info['layers']} layers, hidden size {info['hidden_size']}, {heads}, "
                  f"feed-forward {info['ffn_hidden_size']}, vocabulary {info['vocab_size']}"),
        ("", f"{'RoPE' if info['position'] == 'rope' else 'learned'} positions, "
             f"{'tied' if info['tied_embeddings'] else 'separate'} input/output embeddings"),
        ("layout", f"tensor parallel {lay['tp']} x pipeline parallel {lay['pp']}"
                   + (f", {vs} virtual stages per pipeline rank" if vs > 1 else "")
                   + (" in a V" if info["placement"] == "v" else "") + f": {files}"),
        ("dtype", info["dtype"]),
        ("FP8", fp8),
        ("size", f"{human_bytes(info['size_bytes'])} on disk"),
        ("step", str(info["step"])),
        ("tokenizer", info["tokenizer"] or "none"),
        ("files", "DAMAGED (below)" if info["problems"] else "match the manifest"),
    ]
    if info.get("digests") is not None:
        rows.append(("sha256", {"match": "every file matches the digest recorded when written",
                                "none recorded": "none recorded (not verified)",
                                "damaged": "MISMATCH (below)"}[info["digests"]]))
    return "\n".join([f"Tessera checkpoint {info['path']}"] + [f"  {k:<10} {v}" for k, v in rows])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera inspect", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a Tessera checkpoint directory")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--verify", action="store_true",
                        help="also read every file and check its recorded sha256")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        info = describe(args.checkpoint, verify=args.verify)
    except (ValueError, KeyError) as exc:  # CheckpointError is a ValueError
        print(f"tessera inspect: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else render(info))
    for problem in info["problems"]:
        print(f"tessera inspect: damaged: {problem}", file=sys.stderr)
    return 1 if info["problems"] else 0
