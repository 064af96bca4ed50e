"""Direct preference optimization: preference pairs, the DPO losses, and one training step.

Data: JSONL rows `{"prompt": ..., "chosen": ..., "rejected": ...}`, either conversational
(`prompt` a list of messages, `chosen` / `rejected` lists holding the assistant's turn),
rendered by the chat template (`core.chat_template`, the server's renderer), or plain text
(an EOS is appended to `chosen` and `rejected`). As in TRL, the prompt and each
prompt + completion are tokenized whole, and the completion starts where the two token lists
first differ.

Loss (TRL's definitions): with `logp` the sum of a completion's token log-probabilities under
the policy and `ref` under the reference, the log-ratios `c = logp(chosen) - ref(chosen)`,
`r = logp(rejected) - ref(rejected)` and `d = c - r`:
- `sigmoid`: `-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)` (eps, the label
  smoothing, 0 by default: plain DPO; eps > 0 is the conservative cDPO);
- `ipo`: `(c / n_c - r / n_r - 1 / (2 beta))^2`, n the completions' token counts;
- `robust`: `(-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps)`,
averaged over the pairs. Rewards are `beta c` and `beta r`; accuracy is the share of pairs whose
chosen reward is the higher.

The reference is the base: for LoRA the same model with its adapters switched off (no second
copy of the weights), for full tuning a frozen copy made before the first step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    encode_chat,
    template_specials,
)
from tessera.core.lora import LoRA
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.tokenizer import Tokenizer
from tessera.tuning.data import DataError, read_jsonl

LOSSES = ("sigmoid", "ipo", "robust")


@dataclass
class PreferencePair:
    prompt: list[int]
    chosen: list[int]  # completion tokens after the prompt
    rejected: list[int]
    where: str


def _completion(where: str, obj: dict[str, Any], key: str) -> Any:
    value = obj.get(key)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise DataError(f"{where}: field {key!r} must be text or a list of messages, got {value!r}")


def load_pairs(path: str, template: ChatTemplate, tokenizer: Tokenizer, context: int
               ) -> list[PreferencePair]:
    """Every pair of `path`, tokenized (see the module docstring); a pair longer than
    `context` + 1 tokens is an error naming file and line."""
    pairs = []
    for where, obj in read_jsonl(path):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
        if missing:
            raise DataError(f"{where}: a preference pair needs 'prompt', 'chosen' and "
                            f"'rejected'; missing {missing}")
        prompt, chosen, rejected = (_completion(where, obj, k)
                                    for k in ("prompt", "chosen", "rejected"))
        conversational = isinstance(prompt, list)
        if conversational != isinstance(chosen, list) or conversational != isinstance(rejected, list):
            raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be text or "
                            "all be lists of messages")
        try:
            ids = _tokenized(template, tokenizer, prompt, chosen, rejected, obj.get("tools"))
        except ChatTemplateError as exc:
            raise DataError(f"{where}: {exc}") from None
        pair = PreferencePair(*ids, where=where)
        longest = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
        if longest > context + 1:
            raise DataError(f"{where}: the pair has {longest} tokens, more than the context of "
                            f"{context}; shorten it or raise --seq-len")
        if not pair.chosen or not pair.rejected:
            raise DataError(f"{where}: 'chosen' or 'rejected' adds no token after the prompt")
        pairs.append(pair)
    return pairs


def _tokenized(template: ChatTemplate, tokenizer: Tokenizer, prompt: Any, chosen: Any,
               rejected: Any, tools: Any) -> tuple[list[int], list[int], list[int]]:
    bos = tokenizer.adds_bos
    if isinstance(prompt, list):
        specials = template_specials(tokenizer)

        def encode(messages: list[dict[str, Any]], opened: bool) -> list[int]:
            text = template.render(messages, add_generation_prompt=opened, tools=tools,
                                   **specials)
            return encode_chat(tokenizer, text)

        head, full_chosen, full_rejected = (encode(prompt, True), encode(prompt + chosen, False),
                                            encode(prompt + rejected, False))
    else:
        eos = tokenizer.eos_id is not None
        head = tokenizer.encode(prompt, bos=bos)
        full_chosen = tokenizer.encode(prompt + chosen, bos=bos, eos=eos)
        full_rejected = tokenizer.encode(prompt + rejected, bos=bos, eos=eos)
    start = min(_common_prefix(head, full_chosen), _common_prefix(head, full_rejected))
    return head[:start], full_chosen[start:], full_rejected[start:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_batch(pairs: Sequence[PreferencePair], seq_len: int, pad_id: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens (2B, seq_len)` and `labels`: the chosen sequences, then the rejected ones,
    right-padded; labels are the next tokens of the completions, -100 elsewhere."""
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        full = prompt + completion
        tokens[i, : len(full) - 1] = torch.tensor(full[:-1])
        labels[i, len(prompt) - 1: len(full) - 1] = torch.tensor(completion)
    return tokens, labels


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the summed log-probability of the labelled tokens `(B,)`."""
    mask = labels != -100
    logps = torch.gather(logits.float().log_softmax(-1), 2,
                         labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * mask).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, *,
             beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean DPO loss of a batch and its metrics. `policy`, `reference`: sequence
    log-probabilities `(2B,)` (chosen rows, then rejected); `lengths`: completion token counts
    `(2B,)`."""
    chosen, rejected = (policy - reference).chunk(2)
    delta = chosen - rejected
    eps = label_smoothing
    if loss == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif loss == "ipo":
        n_chosen, n_rejected = lengths.float().clamp(min=1).chunk(2)
        per_pair = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * beta)) ** 2
    elif loss == "robust":
        per_pair = (-(1 - eps) * F.logsigmoid(beta * delta)
                    + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown DPO loss {loss!r}; use {', '.join(LOSSES)}")
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    metrics = {"rewards_chosen": chosen_rewards.mean(), "rewards_rejected": rejected_rewards.mean(),
               "rewards_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
               "rewards_margin": (chosen_rewards - rejected_rewards).mean()}
    return per_pair.mean(), metrics


@contextlib.contextmanager
def adapters_off(stages: Sequence[nn.Module]) -> Iterator[None]:
    """The base model: every LoRA adapter switched off inside, back on after."""
    layers = [m for model in stages for m in model.modules()
              if isinstance(m, ParallelLinear) and isinstance(m.adapter, LoRA)]
    hooks = [m.adapter for m in layers]
    for m in layers:
        m.adapter = None
    try:
        yield
    finally:
        for m, hook in zip(layers, hooks, strict=True):
            m.adapter = hook


class Reference:
    """Sequence log-probabilities under the reference model (see the module docstring)."""

    def __init__(self, model: nn.Module, lora: bool) -> None:
        self.model, self.lora = model, lora
        if not lora:  # full tuning: a frozen copy of the weights as they start
            self.model = _frozen_copy(model)

    @torch.no_grad()
    def logps(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with adapters_off([self.model]) if self.lora else contextlib.nullcontext():
            return sequence_logps(self.model(tokens), labels)


def _frozen_copy(model: nn.Module) -> nn.Module:
    import copy

    frozen = copy.deepcopy(model)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen
