"""A tiny pretrained base and synthetic task data for the tuning tests (nothing downloaded).

    base = make_base(tmp / "base")                  # pretrains a tiny Llama (seconds on a CPU)
    rows = task_examples("kind", "valid")           # [{"task", "input", "answer"}, ...]
    write_jsonl(tmp / "valid.jsonl", rows)
    cfg, _ = load_config(tune_argv(base, tmp / "run", train, valid, "--steps", "20"))

The corpus is sentences about coloured things and animals, with statements tying each word to
its kind ("red is a color", "a dog is an animal"), and, in 40% of the documents, labelled
lists, each item after its header: "kinds: we saw a red box color. kinds: she has a big dog
animal." or "counts: ... one. counts: ... two.". So the base can do both tasks, but only right
after their header; a plain phrase is followed by "." or ",". The virtual prompts must find
that behaviour: with random ones the base rarely answers a label, with tuned ones it answers
the task asked.
Task `kind`: does the phrase mention a color or an animal (labels `color` / `animal`). Task
`count`: one thing or two (labels `one` / `two`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLORS = ("red", "blue", "green", "yellow", "black", "white", "brown", "purple")
ANIMALS = ("dog", "cat", "horse", "bird", "fish", "cow", "sheep", "goat", "mouse", "lion")
OBJECTS = ("box", "car", "hat", "cup", "door", "ball", "book", "chair", "coat", "lamp")
SIZES = ("big", "small", "old", "new", "tall", "little")
VERBS = ("we saw", "she has", "they like", "he found", "i want", "you keep", "we painted",
         "they sold")
VOCAB_SIZE = 384


def _phrase(rng: random.Random, kind: str, count: str = "one") -> str:
    verb = rng.choice(VERBS)
    if kind == "color":
        adj, noun = rng.choice(COLORS), rng.choice(OBJECTS)
    else:
        adj, noun = rng.choice(SIZES), rng.choice(ANIMALS)
    det = "a" if count == "one" else "two"
    return f"{verb} {det} {adj} {noun}{'s' if count == 'two' else ''}"


def corpus(documents: int = 800, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(documents):
        r = rng.random()
        if r < 0.4:  # a labelled list, announced by its header
            header, task = ("kinds:", "kind") if r < 0.15 else ("counts:", "count")
            items = [_labelled(rng, task) for _ in range(rng.randint(3, 6))]
            docs.append(" ".join(f"{header} {text} {label}." for text, label in items))
            continue
        parts = []
        for _ in range(rng.randint(3, 7)):
            r = rng.random()
            if r < 0.2:
                parts.append(f"{rng.choice(COLORS)} is a color.")
            elif r < 0.4:
                parts.append(f"a {rng.choice(ANIMALS)} is an animal.")
            else:
                kind, count = rng.choice(("color", "animal")), rng.choice(("one", "two"))
                tail = rng.choice((f", {'a' if kind == 'color' else 'an'} {kind}",
                                   f", {count} of them", ""))
                parts.append(_phrase(rng, kind, count).capitalize() + tail + ".")
        docs.append(" ".join(parts))
    return docs


def _labelled(rng: random.Random, task: str) -> tuple[str, str]:
    kind, count = rng.choice(("color", "animal")), rng.choice(("one", "two"))
    if task == "kind":
        count = "one"
    return _phrase(rng, kind, count), kind if task == "kind" else count


def task_examples(task: str, split: str, n: int = 160) -> list[dict]:
    """Examples of `task` ("kind" or "count"), in the tasks' JSONL form."""
    rng = random.Random({"train": 1, "valid": 2, "test": 3}[split] * 100 + len(task))
    return [{"task": task, "input": text, "answer": label}
            for text, label in (_labelled(rng, task) for _ in range(n))]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def make_base(directory: Path, steps: int = 100, layers: int = 4, hidden: int = 64) -> Path:
    """Pretrain a tiny Llama on `corpus()` with the real pretraining loop; return its checkpoint."""
    from tessera.core.tokenizer import train_tokenizer
    from tessera.training.config import load_config
    from tessera.training.loop import pretrain
    from tessera.training.preprocess import main as preprocess

    directory.mkdir(parents=True, exist_ok=True)
    text = write_jsonl(directory / "corpus.jsonl", [{"text": d} for d in corpus()])
    tok = directory / "tok.model"
    train_tokenizer([text], VOCAB_SIZE, tok, "bpe", num_threads=1)
    prefix = directory / "corpus"
    assert preprocess(["--input", str(text), "--tokenizer", str(tok), "--output-prefix",
                       str(prefix), "--workers", "1"]) == 0
    run = directory / "run"
    cfg, _ = load_config([
        "--data", str(prefix), "--tokenizer", str(tok), "--model", "llama-tiny",
        "--model-overrides", f"vocab_size={VOCAB_SIZE}", f"num_layers={layers}",
        f"hidden_size={hidden}", "max_position_embeddings=128",
        "--seq-len", "64", "--global-batch", "16", "--steps", str(steps), "--warmup-steps", "10",
        "--lr", "1e-2", "--min-lr", "1e-3", "--eval-interval", "0", "--eval-batches", "1",
        "--save-interval", "0", "--peak-tflops", "1", "--device", "cpu", "--progress", "false",
        "--tensorboard", "false", "--log-interval", "1000", "--output", str(run)])
    summary = pretrain(cfg)
    return Path(summary["checkpoint"])


def random_base_and_tasks(root: Path) -> dict[str, Path]:
    """A random-weight tiny Llama (4 layers) with a tokenizer, saved under `root`, and two
    tasks' train/valid files: what the multi-rank tuning tests compare layouts on."""
    from tessera.core import build_model, save_checkpoint
    from tessera.core.config import ModelConfig
    from tessera.core.tokenizer import train_tokenizer

    tok = root / "tok.model"
    train_tokenizer([], 384, tok, "bpe", texts=corpus(300), num_threads=1)
    config = ModelConfig.from_name("llama-tiny", vocab_size=384, num_layers=4,
                                   max_position_embeddings=64)
    base = save_checkpoint(root / "base", build_model(config, seed=5), tokenizer=tok)
    train = task_examples("kind", "train", 32) + task_examples("count", "train", 32)
    valid = task_examples("kind", "valid", 6) + task_examples("count", "valid", 6)
    return {"root": root, "base": base, "train": write_jsonl(root / "train.jsonl", train),
            "valid": write_jsonl(root / "valid.jsonl", valid)}


def tune_argv(base: Path, output: Path, train: Path, valid: Path | None = None,
              *extra: str) -> list[str]:
    """`tessera tune` flags for a short quiet CPU run; later flags win."""
    argv = ["--checkpoint", str(base), "--data", str(train), "--output", str(output),
            "--virtual-tokens", "8", "--global-batch", "16", "--steps", "40",
            "--warmup-steps", "5", "--add-eos", "false", "--device", "cpu", "--peak-tflops", "1",
            "--progress", "false", "--tensorboard", "false", "--log-interval", "1000",
            "--eval-interval", "0", "--save-interval", "0"]
    if valid is not None:
        argv += ["--valid", str(valid)]
    return [*argv, *extra]
