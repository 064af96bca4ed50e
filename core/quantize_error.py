"""How far a quantized model's logits are from the unquantized model's, measured at load.

`quantize_measured(model, method)` runs a fixed probe (`PROBE_TOKENS` pseudo-random token ids
from a seeded generator, the same on every rank and every start) through the model before and
after `core.quantize.quantize`, and returns a `LogitError`: the relative RMS error of the
logits, their largest absolute difference and how often the top-1 token agrees. The probe is
one forward pass without a KV cache, so it costs about as much as a prompt of that length.

Collective under tensor parallelism (every rank runs the same probe); a pipeline stage that is
not the whole model has no logits of its own, so there it quantizes and returns None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tessera.core.quantize import product, quantize

PROBE_TOKENS = 64
PROBE_SEED = 0


@dataclass(frozen=True)
class LogitError:
    """Quantized vs unquantized logits over `tokens` probe positions."""

    method: str
    relative_rms: float  # ||quantized - reference|| / ||reference||
    max_abs: float
    top1_agreement: float  # fraction of positions whose arg-max token is the same
    tokens: int
    product: str = ""  # how the quantized layers multiply (`core.quantize.product`)

    def describe(self) -> str:
        how = f" ({self.product})" if self.product else ""
        return (f"{self.method} weights{how}: logit error vs the unquantized model "
                f"{self.relative_rms:.2e} relative RMS, max |diff| {self.max_abs:.3g}, top-1 "
                f"agreement {self.top1_agreement:.1%} on a {self.tokens}-token probe")


def probe_ids(vocab_size: int, tokens: int = PROBE_TOKENS, seed: int = PROBE_SEED
              ) -> torch.Tensor:
    """`(1, tokens)` int64 ids in `[0, vocab_size)`, the same for a given seed everywhere."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, tokens), generator=generator)


@torch.no_grad()
def logit_error(reference: torch.Tensor, quantized: torch.Tensor, method: str) -> LogitError:
    """The `LogitError` of `quantized` against `reference`, both `(..., vocab)`."""
    ref, got = reference.float().flatten(0, -2), quantized.float().flatten(0, -2)
    diff = got - ref
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    return LogitError(method, (diff.norm() / ref.norm().clamp(min=1e-30)).item(),
                      diff.abs().max().item(), agree.item(), ref.shape[0])


@torch.no_grad()
def quantize_measured(model: nn.Module, method: str, tokens: int = PROBE_TOKENS
                      ) -> LogitError | None:
    """`quantize(model, method)` in place, and the logit error it caused (None for "none" and
    for a pipeline stage that is not the whole model)."""
    whole = getattr(model, "is_first", True) and getattr(model, "is_last", True)
    if method == "none" or not whole:
        quantize(model, method)
        return None
    device = next(model.parameters()).device
    ids = probe_ids(model.config.vocab_size, min(tokens, model.config.max_position_embeddings)).to(device)
    reference = model(ids).float()
    quantize(model, method)
    return dataclasses.replace(logit_error(reference, model(ids), method),
                               product=product(method, device))
