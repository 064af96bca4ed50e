"""A synthetic two-label task for prompt-tuning the demo base (`tessera pretrain`, no data).

The demo base (about 2.5M parameters, 300 steps on standard-library docstrings) is close to a
bigram model: its next-token guess hardly depends on anything but the last token or two. So the
task puts its clue last. Each example is a short docstring-like sentence that ends with its
subject, `file` or `string`, the rest of it drawn from parts that fit both; the answer is a
single-piece label, `object` after a file and `of` after a string, words that this base puts
after those nouns slightly more often than the other way round, but far below what it really
predicts there ("." or a newline). With random virtual tokens the base answers neither label;
tuned prompts must make it answer, and answer the right one, on sentences never seen in training.

    python -m tessera.tuning.demo_task --output DIR [--seed 0] [--train 512] [--valid 64] [--test 200]

writes `DIR/train.jsonl`, `DIR/valid.jsonl` and `DIR/test.jsonl` (the held-out split), each line
`{"task": "doc_kind", "input": "...", "answer": "object" | "of"}`, balanced between the two
labels. The three splits have no sentence in common, and the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tessera.core.arg_types import non_negative_int, positive_int

TASK = "doc_kind"
SUBJECTS = ("file", "string")
LABELS = {"file": "object", "string": "of"}  # subject -> answer

# Every part fits both subjects, so that only the noun, last, tells them apart.
_LEADS = ("", "Helper function. ", "Internal use only. ", "New in version 3.2. ",
          "Raise ValueError on error. ", "This is not thread safe. ")
_OPENINGS = (
    "Read the data from the", "Write the result to the", "Return the length of the",
    "Check the contents of the", "Copy the data into a new", "Return the name of the",
    "Encode the text of the", "Compare the value with the", "Split the lines of the",
    "Parse the header of the", "Format the output of the", "Close the",
)
_ADJECTIVES = ("", "given ", "current ", "new ", "default ", "first ", "last ", "temporary ",
               "original ", "empty ")


def sentence(rng: random.Random, subject: str) -> str:
    """One docstring-like sentence that ends with its `subject` ("file" or "string")."""
    return f"{rng.choice(_LEADS)}{rng.choice(_OPENINGS)} {rng.choice(_ADJECTIVES)}{subject}"


def build_splits(seed: int = 0, train: int = 512, valid: int = 64,
                 test: int = 200) -> dict[str, list[dict[str, str]]]:
    """`{"train", "valid", "test"}` rows, balanced over the labels, no sentence in two splits."""
    rng = random.Random(seed)
    sizes = {"train": train, "valid": valid, "test": test}
    possible = len(_LEADS) * len(_OPENINGS) * len(_ADJECTIVES)
    per_label = sum((n + 1) // 2 for n in sizes.values())
    if per_label > possible * 3 // 4:  # keep the search for unseen sentences short
        raise ValueError(f"{per_label} sentences per label asked for; at most "
                         f"{possible * 3 // 4} are allowed ({possible} can be made)")
    seen: set[str] = set()
    out: dict[str, list[dict[str, str]]] = {}
    for split, n in sizes.items():
        rows = []
        for i in range(n):
            subject = SUBJECTS[i % 2]
            while (text := sentence(rng, subject)) in seen:
                pass
            seen.add(text)
            rows.append({"task": TASK, "input": text, "answer": LABELS[subject]})
        rng.shuffle(rows)
        out[split] = rows
    return out


def write_splits(directory: str | Path, seed: int = 0, train: int = 512, valid: int = 64,
                 test: int = 200) -> dict[str, Path]:
    """Write `train.jsonl`, `valid.jsonl` and `test.jsonl` under `directory`; their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in build_splits(seed, train, valid, test).items():
        path = paths[split] = directory / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.tuning.demo_task",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for the three JSONL files")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--train", type=positive_int, default=512, help="training examples")
    parser.add_argument("--valid", type=positive_int, default=64, help="validation examples")
    parser.add_argument("--test", type=positive_int, default=200, help="held-out test examples")
    args = parser.parse_args(argv)
    paths = write_splits(args.output, args.seed, args.train, args.valid, args.test)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
