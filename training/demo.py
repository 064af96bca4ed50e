"""The embedded default: `tessera pretrain` with no data pretrains a small Llama on this machine.

1. A corpus from text already here: the docstrings of the installed Python standard library,
   read with `ast` from its source files (nothing imported, nothing downloaded, nothing copied
   into this repository), one document per docstring, into `RUN/data/corpus.jsonl`.
2. A sentencepiece BPE tokenizer trained on it, and an indexed dataset made from it.
3. Pretraining of the `llama-demo` preset (about 2.5M parameters) on the CPU for a few minutes.
4. A sample generation from the final checkpoint, and where that checkpoint is.

Every field of the pretraining config can still be overridden (`--steps 50`, `--tp 2`, ...).
Under several ranks, rank 0 prepares the data while the others wait.

Run again, the demo never deletes its previous run (the checkpoint the README's tuning and
serving examples start from): a finished run (its last checkpoint at `--steps`) is kept and its
samples printed; an unfinished one continues like any other run directory (`--resume auto`,
the default: when its config is this one's; else it is refused, naming `--resume true` and
`--overwrite`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import sysconfig
from pathlib import Path

import torch.distributed as dist

from tessera.core.files import atomic_file
from tessera.training.config import PretrainConfig
from tessera.training.objectives import objective_for

DEMO_PROMPTS = ("Return the", "The default value")


def stdlib_docstrings(limit_bytes: int = 3_000_000) -> list[str]:
    """Docstrings of modules, classes and functions in the standard library's own sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    size = 0
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3") for part in
               path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc.strip())
                    size += len(doc)
        if size >= limit_bytes:
            break
    return docs


def prepare_data(run_dir: Path, vocab_size: int) -> tuple[Path, Path]:
    """Corpus, tokenizer and indexed dataset under `run_dir/data` (reused when present)."""
    from tessera.core.tokenizer import train_tokenizer
    from tessera.training.preprocess import main as preprocess

    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    corpus, tok, prefix = data / "corpus.jsonl", data / "tokenizer.model", data / "corpus"
    if not corpus.is_file():
        docs = stdlib_docstrings()
        with atomic_file(corpus) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for doc in docs:
                fh.write(json.dumps({"text": doc}) + "\n")
        print(f"demo: corpus of {len(docs):,} standard-library docstrings -> {corpus}")
    if not tok.is_file():
        train_tokenizer([str(corpus)], vocab_size, str(tok), model_type="bpe")
        print(f"demo: tokenizer ({vocab_size} pieces) -> {tok}")
    if not Path(str(prefix) + ".idx").is_file():
        preprocess(["--input", str(corpus), "--tokenizer", str(tok), "--output-prefix",
                    str(prefix), "--workers", "2", "--overwrite"])  # a .bin without .idx is partial
    return tok, prefix


def demo_config(cfg: PretrainConfig, explicit: set[str]) -> PretrainConfig:
    """`cfg` with the demo's own defaults for every field not given on the command line
    (`explicit`). Its micro-batches are the run plan's to decide (`demo_fills_pipeline`)."""
    loop, train = {}, {}
    if "output" not in explicit:
        loop["output"] = "runs/demo"
    if "steps" not in explicit:
        train["steps"] = 300
    if "eval_interval" not in explicit:
        loop["eval_interval"] = 100
    if "save_interval" not in explicit:
        loop["save_interval"] = 100
    return dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, **loop),
                               train=dataclasses.replace(cfg.train, **train))


def demo_fills_pipeline(explicit: set[str]) -> bool:
    """Whether the demo's plan picks the micro-batches (2 per pipeline stage: the user gave
    none, `run_plan.resolve_micro_batches`)."""
    return "micro_batches" not in explicit


def run_demo(cfg: PretrainConfig, explicit: set[str]) -> None:
    """Prepare the demo data (rank 0), pretrain, and print a sample from the checkpoint."""
    from tessera.training.loop import check_output, join_world, pretrain
    from tessera.training.run_plan import resolve_plan

    cfg = demo_config(cfg, explicit)
    fill = demo_fills_pipeline(explicit)
    # A layout that cannot run is refused before any data is prepared or directory made.
    resolve_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")), fill_pipeline=fill)
    check_output(cfg.loop.output)  # before preparing data there
    run_dir = Path(cfg.loop.output)
    join_world(cfg.train.device, cfg.loop.collective_timeout_s)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    finished = None if cfg.loop.resume == "true" or cfg.loop.overwrite else finished_run(cfg)
    if finished is not None:
        if rank0:
            print(f"demo: {run_dir} already holds a finished demo run; kept, its samples are "
                  "below (to train it again: `python -m tessera pretrain --overwrite`, which deletes "
                  "it, or `python -m tessera pretrain --output DIR` for a new directory)")
            print_result(cfg, str(finished))
        return
    if rank0:
        tok, prefix = prepare_data(run_dir, cfg.model.vocab_size)
    if dist.is_initialized():
        dist.barrier()
    tok, prefix = run_dir / "data" / "tokenizer.model", run_dir / "data" / "corpus"
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data=[str(prefix)],
                                                           tokenizer=str(tok)))
    summary = pretrain(cfg, fill_pipeline=fill)
    if rank0 and summary.get("checkpoint"):
        print_result(cfg, summary["checkpoint"])


def finished_run(cfg: PretrainConfig) -> Path | None:
    """The last checkpoint of the run in the output directory if that run reached `steps`
    (the demo it would start is already done), else None."""
    from tessera.training.state import latest_checkpoint

    latest = latest_checkpoint(cfg.loop.output)
    if latest is None or int(latest.name.removeprefix("step-")) != cfg.train.steps:
        return None
    return latest


def print_result(cfg: PretrainConfig, checkpoint: str) -> None:
    """Samples of the demo's checkpoint and where it is."""
    samples = objective_for(cfg.model).print_samples or print_samples  # the family's
    samples(checkpoint)


def print_samples(checkpoint: str) -> None:
    from tessera.core.checkpoint import load_checkpoint
    from tessera.core.generation import generate_ids
    from tessera.core.tokenizer import load_tokenizer

    model = load_checkpoint(checkpoint)
    tokenizer = load_tokenizer(Path(checkpoint) / "tokenizer.model")
    print("\nsamples (greedy):")
    for prompt in DEMO_PROMPTS:
        prompt_ids = tokenizer.encode(prompt, bos=True)
        ids = generate_ids(model, prompt_ids, 40, eos_id=tokenizer.eos_id)
        # Decoded with the prompt: alone, the first new piece would lose its leading space.
        print(f"  {prompt!r} -> {tokenizer.decode(prompt_ids + list(ids))!r}")
    print(f"\ncheckpoint: {checkpoint}\n  generate: tessera generate --checkpoint {checkpoint} "
          f"\"Return the\"\n  inspect:  tessera inspect {checkpoint}")
