"""A tiny pretraining setup shared by the loop tests: corpus, tokenizer, indexed data, argv.

    data = make_tiny_data(tmp_dir)          # once per module (a module-scoped fixture)
    cfg, _ = load_config(pretrain_argv(data, tmp_dir / "run", "--steps", "8"))
    losses = read_losses(tmp_dir / "run")   # {step: loss} from RUN/metrics.jsonl
    rewind_run(tmp_dir / "run", tmp_dir / "early", 4)  # the run as of its step-4 checkpoint

The corpus is synthetic sentences from a small grammar, so a tiny model learns it within tens of
steps; nothing is downloaded. Building it takes well under a second.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SUBJECTS = ("the cat", "a small dog", "my old friend", "the quiet river", "every student",
            "the red train", "a tired bird", "the tall tree")
VERBS = ("sees", "follows", "likes", "finds", "carries", "watches", "remembers", "paints")
OBJECTS = ("the moon", "a green apple", "the long road", "two blue boats", "the warm bread",
           "a bright lamp", "the open door", "her new book")
VOCAB_SIZE = 320


@dataclass(frozen=True)
class TinyData:
    prefix: Path  # PREFIX of PREFIX.bin / PREFIX.idx
    tokenizer: Path  # sentencepiece .model
    vocab_size: int


def make_tiny_data(directory: Path, documents: int = 600, seed: int = 0) -> TinyData:
    """Write a JSONL corpus, train a BPE tokenizer on it and preprocess it into `directory`."""
    from tessera.core.tokenizer import train_tokenizer
    from tessera.training.preprocess import main as preprocess

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as fh:
        for _ in range(documents):
            text = " ".join(
                f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                for _ in range(rng.randint(2, 6))
            )
            fh.write(json.dumps({"text": text}) + "\n")
    tokenizer = directory / "tok.model"
    train_tokenizer([corpus], VOCAB_SIZE, tokenizer, "bpe", num_threads=1)
    prefix = directory / "corpus"
    argv = ["--input", str(corpus), "--tokenizer", str(tokenizer), "--output-prefix", str(prefix),
            "--workers", "1"]
    assert preprocess(argv) == 0
    return TinyData(prefix, tokenizer, VOCAB_SIZE)


def pretrain_argv(data: TinyData, output: Path, *extra: str, model: str = "llama-tiny") -> list[str]:
    """`tessera pretrain` flags for a short fp32 run of a 4-layer tiny model on `data`.

    Later flags win, so `extra` overrides any of these (e.g. `--steps 30`).
    """
    return [
        "--data", str(data.prefix), "--tokenizer", str(data.tokenizer),
        "--model", model, "--model-overrides", f"vocab_size={data.vocab_size}", "num_layers=4",
        "--seq-len", "32", "--global-batch", "8", "--micro-batches", "2", "--precision", "fp32",
        "--steps", "8", "--warmup-steps", "2", "--lr", "3e-3",
        "--eval-batches", "1", "--eval-interval", "0", "--save-interval", "4", "--keep-last", "3",
        "--log-interval", "1", "--peak-tflops", "1", "--device", "cpu",
        "--progress", "false", "--tensorboard", "false", "--output", str(output),
        *extra,
    ]


def read_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} from `RUN/metrics.jsonl`; a step logged again after a resume keeps its last value."""
    losses: dict[int, float] = {}
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if "step" in record:
                losses[record["step"]] = record["loss"]
    return losses


def rewind_run(run: Path, to: Path, step: int) -> None:
    """Copy the run directory `run` to `to` as it was right after its checkpoint at `step`."""
    shutil.copytree(run, to)
    checkpoints = to / "checkpoints"
    for later in checkpoints.glob("step-*"):
        if int(later.name.removeprefix("step-")) > step:
            shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step-{step:08d}\n")
    (to / "metrics.jsonl").unlink()


def tessera_command(*argv: str) -> list[str]:
    """The command line that runs `python -m tessera ARGV` with this interpreter."""
    return [sys.executable, "-m", "tessera", *argv]
