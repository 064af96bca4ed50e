"""Shared fixtures for the data-pipeline tests: a generated corpus and a tokenizer trained on it.

Nothing is downloaded: the corpus is synthetic sentences (with accents, digits and a CJK word,
so byte fallback and digit splitting are exercised) and the tokenizer is trained in a second.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tessera.core.tokenizer import SentencePieceTokenizer, train_tokenizer

WORDS = (
    "the a model learns tokens from text every step data flows through layers of attention "
    "and the loss falls slowly while river stone garden window café naïve über 東京 "
    "parallel pipeline tensor sequence shard rank gradient batch 2024 31337 v1.5"
).split()


def make_documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents of 1-4 lines of synthetic sentences; deterministic for a seed."""
    rng = random.Random(seed)

    def sentence() -> str:
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        return " ".join(words).capitalize() + rng.choice(".!?")

    return ["\n".join(sentence() for _ in range(rng.randint(1, 4))) for _ in range(n)]


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return make_documents(240)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory, documents: list[str]) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    train_tokenizer([], 400, path, "bpe", texts=documents, num_threads=1)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path: Path) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(tokenizer_path.read_bytes())
