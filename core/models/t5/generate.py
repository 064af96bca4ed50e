"""Greedy text-to-text generation with a T5 (`core.models.t5.model.T5Model`, one pipeline stage, any tp).

The encoder runs once; the decoder then takes one token per step, its self-attention keys and
values kept in a `T5Cache` together with the cross-attention keys and values of the encoder
output (computed on the first step). This is Hugging Face `generate`'s greedy search for T5:
start from `options.decoder_start_token_id`, take the argmax, and once a row has produced EOS it
continues with the pad id until every row has, or `max_new_tokens` are made.
"""

from __future__ import annotations

import torch

from tessera.core.models.t5.model import T5Cache, T5Model


@torch.no_grad()
def t5_greedy(model: T5Model, encoder_ids: torch.Tensor,
              encoder_mask: torch.Tensor | None = None, *, max_new_tokens: int = 32,
              eos_id: int | None = None, pad_id: int = 0) -> torch.Tensor:
    """The generated ids `(B, n)`, `n <= max_new_tokens` (the start token not included), of
    `encoder_ids (B, S)` (`encoder_mask (B, S)`: 1 = real token). Every tp rank calls it alike."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        enc = model.encode(encoder_ids, encoder_mask)
        cache = T5Cache()
        B = encoder_ids.shape[0]
        step = torch.full((B, 1), model.config.options.decoder_start_token_id, dtype=torch.long,
                          device=encoder_ids.device)
        done = torch.zeros(B, dtype=torch.bool, device=encoder_ids.device)
        out = []
        for _ in range(max_new_tokens):
            logits = model.decode(step, enc, encoder_mask, cache)[:, -1]
            token = logits.argmax(dim=-1)
            if eos_id is not None:
                token = token.masked_fill(done, pad_id)
                done |= token == eos_id
            out.append(token)
            if eos_id is not None and bool(done.all()):
                break
            step = token.unsqueeze(1)
        return torch.stack(out, dim=1)
    finally:
        model.train(was_training)
