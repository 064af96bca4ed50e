"""Single-process text generation with the KV cache: greedy or temperature / top-k / top-p.

The small, dependency-free path the demo, `tessera generate --checkpoint` and tests use. The
server's engine (continuous batching, many requests) is built on the same model interface.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.core.kv_cache import KVCache
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.sharding import kv_geometry
from tessera.core.sampling import RowSettings, choose_tokens


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids `(B,)` from last-position logits `(B, V)`; temperature 0 is greedy.

    A thin single-setting front of `core.sampling.choose_tokens` (the one sampler).
    """
    B, device = logits.shape[0], logits.device
    settings = RowSettings(torch.full((B,), float(temperature), device=device),
                           torch.full((B,), int(top_k), device=device),
                           torch.full((B,), float(top_p), device=device))
    uniforms = None
    if temperature > 0:
        where = generator.device if generator is not None else "cpu"
        uniforms = torch.rand(B, generator=generator, device=where).to(device)
    return choose_tokens(logits, settings, uniforms)


@torch.no_grad()
def generate_ids(model: GPTModel, prompt: list[int], max_new_tokens: int, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_id: int | None = None, seed: int | None = None,
                 on_token: Callable[[int], bool] | None = None) -> list[int]:
    """Continue `prompt` by up to `max_new_tokens` tokens (stopping after `eos_id`).

    `on_token(token)` is called with each new token as it is sampled; returning True stops
    generation there (e.g. a stop string completed)."""
    config = model.config
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token (e.g. BOS)")
    total = min(len(prompt) + max_new_tokens, config.max_position_embeddings)
    if len(prompt) >= config.max_position_embeddings:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of "
                         f"{config.max_position_embeddings}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    entry = kv_geometry(config, model.groups.tp_size)
    cache = KVCache(model.layer_ids, 1, total, entry.heads, entry.key_dim, dtype, device,
                    value_dim=entry.value_dim)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    slots = torch.zeros(1, dtype=torch.long, device=device)
    ids = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)[None]
    out: list[int] = []
    while len(prompt) + len(out) < total:
        logits = model(ids, positions=positions, cache=cache, slots=slots)[:, -1]
        token = int(sample_next(logits, temperature, top_k, top_p, gen)[0])
        out.append(token)
        if eos_id is not None and token == eos_id:
            break
        if on_token is not None and on_token(token):
            break
        next_pos = len(prompt) + len(out) - 1
        ids = torch.tensor([[token]], device=device)
        positions = torch.tensor([[next_pos]], device=device)
    return out
