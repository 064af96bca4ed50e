"""Packed tuning rows: several examples in one row, each its own document.

An example's inputs are its sequence minus the last token and its targets the next tokens
(`data.make_batch`'s row, unpadded); a packed row puts whole examples back to back in data
order, first fit into `seq_len` tokens, and pads the rest. Each example is a document
(`document_ids`, the model's packed-document input, which `--isolate-documents` uses in
pretraining): positions restart at every example and no token attends to another example, so
every example's loss terms are those it has in a row of its own. Packs are fixed when the data
is loaded, so global batch `step` is a function of the step alone, as unpacked.
"""

from __future__ import annotations

import torch

from tessera.tuning.data import Example, sequence, targets


def pack(examples: list[Example], n_virtual: dict[str, int], seq_len: int) -> list[list[int]]:
    """Indices of `examples` per packed row, in order: each example joins the first open row
    with room for it (rows stay open while any has room)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, ex in enumerate(examples):
        need = _input_length(ex, n_virtual)
        if need > seq_len:
            raise ValueError(f"{ex.where}: {need} tokens do not fit a row of {seq_len}")
        row = next((r for r, free in enumerate(room) if free >= need), None)
        if row is None:
            rows.append([])
            room.append(seq_len)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= need
    return rows


def _input_length(ex: Example, n_virtual: dict[str, int]) -> int:
    return n_virtual[ex.task] + len(ex.prompt) + len(ex.answer) - 1


def make_packed_batch(rows: list[list[Example]], task_index: dict[str, int],
                      n_virtual: dict[str, int], seq_len: int, pad_id: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tokens`, `labels` and `document_ids`, each `(B, seq_len)`: the examples of each row
    back to back, then padding (a document of its own, with no labels)."""
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    documents = torch.empty((len(rows), seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, ex in enumerate(row):
            n = n_virtual[ex.task]
            full = sequence(ex, task_index[ex.task], n)
            end = at + len(full) - 1
            tokens[r, at:end] = torch.tensor(full[:-1])
            labels[r, at:end] = torch.tensor(targets(ex, full, n))
            documents[r, at:end] = d
            at = end
        documents[r, at:] = len(row)
    return tokens, labels, documents
