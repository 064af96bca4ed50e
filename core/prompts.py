"""Virtual prompts at inference: the embedding hook that applies prompt-tuned tables.

A task is a table of virtual-token embeddings `(n_virtual, hidden)`. `VirtualPrompts` is the
model's `embedding_hook` (see `core.models.decoder.model`), attached by composition on the first
pipeline stage, after the vocabulary-parallel embedding: it replaces the embeddings at positions
`[0, n_virtual)` of each row that uses a task. Which task a row uses comes from `set_rows(...)`
when its owner (the serving engine) sets it, else from the row's token id at position 0, which
tuning batches set to the task's index (see `tuning.data`): context carried by the ids reaches
each micro-batch of a pipeline schedule, which a per-batch attribute would not.

Tuning trains through the same hook with trainable prompt modules (`tuning.prompts`), so served
and tuned prompts behave alike; the server attaches baked tables (`fixed_prompts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

HOOK = "embedding_hook"  # the GPTModel attribute the prompts are attached under


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


def attach_prompts(model: nn.Module, prompts: VirtualPrompts) -> VirtualPrompts:
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


def fixed_prompts(tables: dict[str, torch.Tensor], rows_from_ids: bool = False) -> VirtualPrompts:
    """Inference prompts from baked tables (what `load_prompt_tables` returns). By default
    they touch only rows named with `set_rows`, as a server batching mixed requests needs."""
    return VirtualPrompts({name: FixedPrompt(t) for name, t in tables.items()}, rows_from_ids)
