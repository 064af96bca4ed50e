"""The shapes of T5 span-corruption samples: pure arithmetic, no tensors.

Span corruption (Raffel et al. 2020, section 3.1.4) replaces about `noise_density` of a raw
window's tokens by sentinels, one per span of mean length `mean_span`; the encoder reads the
kept tokens, a sentinel per span and EOS, the decoder the target: a sentinel per span, the noise
tokens and EOS. `training.t5_data` draws the samples; the planner (`tessera.plan`, which may not
import torch) reads the same lengths from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SpanShape:
    """The counts of one raw length: its expected noise tokens `raw_length x noise_density`,
    rounded up or down at random per sample (so the mean is exact), and the bounds that fix
    every sample's shapes."""

    raw_length: int
    noise_density: float
    mean_span: float

    @property
    def noise_range(self) -> tuple[int, int]:
        x = self.raw_length * self.noise_density
        return (min(max(math.floor(x), 1), self.raw_length - 1),
                min(max(math.ceil(x), 1), self.raw_length - 1))

    @property
    def max_spans(self) -> int:
        return max(math.ceil(self.noise_range[1] / self.mean_span), 1)

    @property
    def encoder_length(self) -> int:
        """The longest encoder input: kept tokens + one sentinel per span + EOS."""
        return self.raw_length - self.noise_range[0] + self.max_spans + 1

    @property
    def target_length(self) -> int:
        """The longest target: one sentinel per span + the noise + EOS."""
        return self.noise_range[1] + self.max_spans + 1


def fit_raw_length(encoder_length: int, noise_density: float = 0.15, mean_span: float = 3.0
                   ) -> SpanShape:
    """The longest raw length whose corrupted encoder input always fits `encoder_length`."""
    if encoder_length < 4:
        raise ValueError(f"encoder_length must be at least 4, got {encoder_length}")
    raw = 2
    while SpanShape(raw + 1, noise_density, mean_span).encoder_length <= encoder_length:
        raw += 1
    return SpanShape(raw, noise_density, mean_span)
