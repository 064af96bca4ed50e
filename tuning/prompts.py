"""Virtual prompts: what prompt tuning and p-tuning learn, and the embedding hook that uses them.

- Prompt tuning (Lester et al. 2021, https://arxiv.org/abs/2104.08691): each task's virtual
  token embeddings `(n_virtual, hidden)` are the parameters (`PromptEmbedding`), started from the
  embeddings of random vocabulary tokens or of a text.
- P-tuning (Liu et al. 2021, https://arxiv.org/abs/2103.10385): each task's embeddings come out
  of a small encoder, an MLP or a bidirectional LSTM with an MLP head, over learned inputs
  (`PromptEncoder`). After training its output is baked into a fixed table (`FixedPrompt`), so
  inference needs no encoder.

`VirtualPrompts` is the model's `embedding_hook` (see `core.models.decoder.model`), attached by composition on
the first pipeline stage, after the vocabulary-parallel embedding: it replaces the embeddings
at positions `[0, n_virtual)` of each row that uses a task. Which task a row uses comes from
`set_rows(...)` when its owner (the serving engine) sets it, else from the row's token id at
position 0, which tuning batches set to the task's index (see `tuning.data`): context carried
by the ids reaches each micro-batch of a pipeline schedule, which a per-batch attribute would not.

The base stays frozen by construction: `mark_only_prompt_as_trainable` leaves `requires_grad`
only on names that `prompt_filter` accepts, the optimizer gets only those, and tuning
checkpoints store only them. The virtual embeddings are replicated over tensor-parallel ranks;
their gradient arrives identical on every tp rank (it flows back through the column-parallel
input copy, whose backward is an all-reduce), and data parallelism averages it like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.core.models.decoder.model import GPTModel

HOOK = "embedding_hook"  # the GPTModel attribute the prompts are attached under


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


class FixedPrompt(nn.Module):
    """A baked prompt table for inference (a buffer: nothing to train)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.n_virtual = table.shape[0]
        self.register_buffer("table", table.detach().clone().float())

    def forward(self) -> torch.Tensor:
        return self.table


class VirtualPrompts(nn.Module):
    """The embedding hook: per task, a module whose `forward()` gives `(n_virtual, C)`."""

    def __init__(self, prompts: dict[str, nn.Module], rows_from_ids: bool = True):
        super().__init__()
        self.prompts = nn.ModuleDict(prompts)
        self.tasks = list(prompts)
        # Without `set_rows`: read each row's task from its position-0 id (tuning batches), or
        # leave every row alone (inference, where the engine names the rows).
        self.rows_from_ids = rows_from_ids
        self._rows: torch.Tensor | None = None
        # Learned position embeddings are added to the virtual tokens too (as Hugging Face
        # models do to `inputs_embeds`); set by `attach_prompts`, not a submodule of the hook.
        self.add_positions: Callable[[torch.Tensor], torch.Tensor] | None = None

    def n_virtual(self) -> dict[str, int]:
        return {name: m.n_virtual for name, m in self.prompts.items()}

    def task_index(self, name: str) -> int:
        if name not in self.prompts:
            raise KeyError(f"unknown task {name!r}; the prompts hold {', '.join(self.tasks)}")
        return self.tasks.index(name)

    def set_rows(self, rows: list[str | None] | torch.Tensor | None) -> None:
        """Which task each row of the next forward calls uses (a name, or None for none).

        `None` instead of a list clears it (back to `rows_from_ids`). The engine sets this
        before every forward; tuning never does.
        """
        if rows is None or isinstance(rows, torch.Tensor):
            self._rows = rows
            return
        self._rows = torch.tensor([-1 if r is None else self.task_index(r) for r in rows])

    def tables(self) -> dict[str, torch.Tensor]:
        """Each task's current virtual embeddings, fp32 on the CPU (the encoder baked in)."""
        with torch.no_grad():
            return {name: m().detach().float().cpu().clone() for name, m in self.prompts.items()}

    def forward(self, h: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._rows is not None:
            rows = self._rows.to(ids.device)
            if rows.shape[0] != ids.shape[0]:
                raise ValueError(f"set_rows gave {rows.shape[0]} rows, the batch has "
                                 f"{ids.shape[0]}")
        elif self.rows_from_ids:  # tuning batches: the virtual slots' ids are the task index
            rows = torch.where(positions[:, 0] == 0, ids[:, 0], -1)
        else:
            return h
        for k, module in enumerate(self.prompts.values()):
            table = module()  # (n, C)
            n = table.shape[0]
            mask = (rows == k)[:, None] & (positions < n)  # (B, T)
            virtual = table[positions.clamp(max=n - 1)]  # (B, T, C)
            if self.add_positions is not None:
                virtual = virtual + self.add_positions(positions)
            h = torch.where(mask[..., None], virtual.to(h.dtype), h)
        return h


def attach_prompts(model: GPTModel, prompts: VirtualPrompts) -> VirtualPrompts:
    """Attach `prompts` as the first stage's embedding hook, on the model's device."""
    if not model.is_first:
        raise ValueError("virtual prompts belong on the first pipeline stage (it embeds tokens)")
    if prompts.prompts:
        prompts.to(next(model.parameters()).device)
    if model.config.position == "learned":
        # The bound method, not the module: assigning a module would register it in the hook.
        prompts.add_positions = model.pos_embeddings.forward
    model.embedding_hook = prompts
    return prompts


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


def fixed_prompts(tables: dict[str, torch.Tensor], rows_from_ids: bool = False) -> VirtualPrompts:
    """Inference prompts from baked tables (what `load_prompt_tables` returns). By default
    they touch only rows named with `set_rows`, as a server batching mixed requests needs."""
    return VirtualPrompts({name: FixedPrompt(t) for name, t in tables.items()}, rows_from_ids)


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
