"""BERT fill-mask: `POST /v1/fill_mask`, the one route a masked-LM checkpoint serves.

    curl -s localhost:8000/v1/fill_mask -H 'Content-Type: application/json' \
        -d '{"text": "The cat [MASK] the moon.", "top_k": 3}'
    {"model": "bert", "masks": [[{"token_id": 57, "token": " sees", "score": 0.41}, ...]]}

The text is tokenized around each literal `[MASK]` (at least one, at most `MAX_MASKS`), wrapped
as `[CLS] ... [SEP]` and run once through the encoder; for each mask, in order, the `top_k`
ordinary tokens by probability (softmax over the vocabulary, special tokens excluded) with their
text. Special ids: a Hugging Face tokenizer that has `[CLS]`, `[SEP]` and `[MASK]` tokens (an
imported BERT) uses its own; otherwise they are the last four ids of the model's vocabulary, as
`tessera pretrain` appends them (`training.bert_dataset.BertSpecials`).

Why a route of its own: the OpenAI, Triton and Megatron routes are generation (a prompt in,
new tokens out, through the KV-cache engine), which an encoder does not do; fill-mask is one
forward pass, so it runs in the request (no engine, no batching across requests) on one process.
`tessera serve --checkpoint BERT_CKPT` serves this app (`/v1/fill_mask`, `/v1/models`, `/health`,
with `--api-key` and the body-size limit of the generation server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from tessera.core.tokenizer import Tokenizer

MASK_TEXT = "[MASK]"
MAX_MASKS = 16


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    special: tuple[int, ...]  # never predicted


def special_ids(tokenizer: Tokenizer, model_vocab: int) -> SpecialIds:
    """The tokenizer's own `[CLS]`/`[SEP]`/`[MASK]` when it has them, else the last four ids of
    the model's vocabulary (the order `tessera pretrain` appends them in)."""
    lookup = getattr(getattr(tokenizer, "_tok", None), "token_to_id", None)
    own = [lookup(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")] if lookup else [None] * 4
    if None not in own[:3]:
        return SpecialIds(own[0], own[1], own[2], tuple(i for i in own if i is not None))
    base = model_vocab - 4
    return SpecialIds(base, base + 1, base + 2, tuple(range(base, model_vocab)))


class FillMask:
    """A BERT model (one process) and its tokenizer, answering fill-mask queries."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, model_name: str = "bert"):
        self.model, self.tokenizer, self.model_name = model.eval(), tokenizer, model_name
        self.ids = special_ids(tokenizer, model.config.vocab_size)

    def encode(self, text: str) -> list[int]:
        """`[CLS] text [SEP]` with each literal `[MASK]` as the mask id."""
        pieces = text.split(MASK_TEXT)
        if len(pieces) < 2:
            raise ValueError(f"the text has no {MASK_TEXT}: put one where a word should be filled")
        if len(pieces) - 1 > MAX_MASKS:
            raise ValueError(f"the text has {len(pieces) - 1} masks; at most {MAX_MASKS}")
        ids = [self.ids.cls]
        for i, piece in enumerate(pieces):
            if i:
                ids.append(self.ids.mask)
            ids += self.tokenizer.encode(piece) if piece else []
        ids.append(self.ids.sep)
        limit = self.model.config.max_position_embeddings
        if len(ids) > limit:
            raise ValueError(f"the text is {len(ids)} tokens with [CLS] and [SEP]; the model "
                             f"takes at most {limit}")
        return ids

    @torch.no_grad()
    def predict(self, text: str, top_k: int = 5) -> list[list[dict[str, Any]]]:
        """For each mask, in order: the `top_k` tokens `{token_id, token, score}`."""
        ids = torch.tensor([self.encode(text)])
        logits = self.model(ids)[0].float()  # (T, V)
        logits[:, list(self.ids.special)] = float("-inf")
        probs = logits.softmax(-1)
        out = []
        for pos in (ids[0] == self.ids.mask).nonzero().flatten().tolist():
            scores, best = probs[pos].topk(min(top_k, probs.shape[-1]))
            out.append([{"token_id": int(i), "token": self.tokenizer.decode([int(i)]),
                         "score": float(s)} for s, i in zip(scores, best)])
        return out


class FillMaskRequest(BaseModel):
    text: str = Field(description=f"text with one or more literal {MASK_TEXT}")
    top_k: int = Field(5, ge=1, le=100, description="predictions per mask")


def create_fill_mask_app(fill: FillMask, *, api_key: str | None = None,
                         max_body_bytes: int = 1 << 20) -> FastAPI:
    """The HTTP app of one fill-mask model (see the module docstring)."""
    from tessera.serving.http.security import GuardMiddleware

    app = FastAPI(title=f"Tessera fill-mask: {fill.model_name}", redoc_url=None,
                  description="BERT fill-mask (POST /v1/fill_mask).")

    @app.post("/v1/fill_mask")
    def fill_mask(request: FillMaskRequest) -> dict[str, Any]:
        try:
            masks = fill.predict(request.text, request.top_k)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        return {"model": fill.model_name, "masks": masks}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": fill.model_name, "object": "model",
                                            "owned_by": "tessera", "task": "fill-mask"}]}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def fill_mask_app(checkpoint: str, model_name: str, *, dtype: str | None = None,
                  api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The fill-mask app of the BERT checkpoint at `checkpoint` (`serving.http.family_apps` picks it
    for `tessera serve`), answering as `model_name`."""
    from tessera.core.checkpoint import load_checkpoint
    from tessera.core.tokenizer import load_tokenizer

    model = load_checkpoint(checkpoint, dtype=dtype)
    fill = FillMask(model, load_tokenizer(checkpoint), model_name)
    return create_fill_mask_app(fill, api_key=api_key, max_body_bytes=max_body_bytes)
