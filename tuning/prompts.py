"""Virtual prompts: what prompt tuning and p-tuning learn.

- Prompt tuning (Lester et al. 2021, https://arxiv.org/abs/2104.08691): each task's virtual
  token embeddings `(n_virtual, hidden)` are the parameters (`PromptEmbedding`), started from the
  embeddings of random vocabulary tokens or of a text.
- P-tuning (Liu et al. 2021, https://arxiv.org/abs/2103.10385): each task's embeddings come out
  of a small encoder, an MLP or a bidirectional LSTM with an MLP head, over learned inputs
  (`PromptEncoder`). After training its output is baked into a fixed table
  (`core.prompts.FixedPrompt`), so inference needs no encoder.

The trainable modules plug into the inference hook `core.prompts.VirtualPrompts` (the same one
the server uses, so served and tuned prompts behave alike). The base stays frozen by
construction: `mark_only_prompt_as_trainable` leaves `requires_grad` only on names that
`prompt_filter` accepts, the optimizer gets only those, and tuning checkpoints store only them.
The virtual embeddings are replicated over tensor-parallel ranks; their gradient arrives
identical on every tp rank (it flows back through the column-parallel input copy, whose
backward is an all-reduce), and data parallelism averages it like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.core.prompts import HOOK, VirtualPrompts


def prompt_filter(name: str) -> bool:
    """True for the parameter names (relative to a `GPTModel`) that tuning trains and saves."""
    return name.startswith(HOOK + ".")


def mark_only_prompt_as_trainable(model: nn.Module) -> None:
    """Freeze every parameter except the prompt ones (`prompt_filter`)."""
    for name, p in model.named_parameters():
        p.requires_grad_(prompt_filter(name))


class PromptEmbedding(nn.Module):
    """Prompt tuning: the virtual token embeddings are the parameters."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.n_virtual = init.shape[0]
        self.weight = nn.Parameter(init.detach().clone().float())  # (n_virtual, C)

    def forward(self) -> torch.Tensor:
        return self.weight


class PromptEncoder(nn.Module):
    """P-tuning: `(n_virtual, C)` embeddings from an MLP or a bidirectional LSTM + MLP head,
    over one learned input vector per virtual token."""

    def __init__(self, init: torch.Tensor, kind: str = "mlp", width: int = 0):
        super().__init__()
        n, hidden = init.shape
        width = width or hidden
        self.n_virtual, self.kind = n, kind
        self.inputs = nn.Parameter(init.detach().clone().float())  # (n_virtual, C)
        head_in = hidden
        if kind == "lstm":
            self.lstm = nn.LSTM(hidden, width // 2, num_layers=2, bidirectional=True,
                                batch_first=True)
            head_in = 2 * (width // 2)
        elif kind != "mlp":
            raise ValueError(f"unknown p-tuning encoder {kind!r}; use mlp or lstm")
        self.mlp = nn.Sequential(nn.Linear(head_in, width), nn.ReLU(), nn.Linear(width, hidden))

    def forward(self) -> torch.Tensor:
        x = self.inputs
        if self.kind == "lstm":
            x = self.lstm(x[None])[0][0]  # (n_virtual, 2 * (width // 2))
        return self.mlp(x)


def build_prompts(method: str, inits: dict[str, torch.Tensor], *, encoder: str = "mlp",
                  encoder_hidden: int = 0, seed: int = 0) -> VirtualPrompts:
    """The trainable prompts of every task, from their initial `(n_virtual, C)` embeddings.

    Encoder weights are drawn from a generator seeded by `seed` and the task's position, so
    every rank builds the same ones.
    """
    modules: dict[str, nn.Module] = {}
    for k, (name, init) in enumerate(inits.items()):
        if method == "prompt-tuning":
            modules[name] = PromptEmbedding(init)
        elif method == "p-tuning":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 7919 + k)
                modules[name] = PromptEncoder(init, encoder, encoder_hidden)
        else:
            raise ValueError(f"unknown method {method!r}; use prompt-tuning or p-tuning")
    return VirtualPrompts(modules)


def initial_embeddings(embedding: torch.Tensor, n_virtual: dict[str, int], *, init: str,
                       text_ids: list[int] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Start values per task: rows of the vocabulary `embedding (V, C)`, of random tokens
    (seeded per task) or of `text_ids` tiled to length."""
    out = {}
    for k, (name, n) in enumerate(n_virtual.items()):
        if init == "text":
            if not text_ids:
                raise ValueError("init 'text' needs a non-empty text")
            ids = (text_ids * (n // len(text_ids) + 1))[:n]
        else:
            gen = torch.Generator().manual_seed(seed * 7919 + k)
            ids = torch.randint(0, embedding.shape[0], (n,), generator=gen).tolist()
        out[name] = embedding[torch.tensor(ids)].float().clone()
    return out
