"""Pretraining objectives: what a model family brings to the pretraining loop.

The loop (`training.loop`) is written once for every family. What differs between them is
gathered in one `Objective`, picked by the model's family (`objective_for`):

- `problems(plan)`: the settings this family cannot take, each a message that says what to do
  (BERT: context parallelism, isolated documents, a next-sentence head in a pipeline);
- `model_vocab(data_vocab, set_vocab)`: the model vocabulary for a tokenizer (or data) of
  `data_vocab` tokens; `set_vocab` is the user's explicit `vocab_size` or None. It raises
  ValueError when the explicit one cannot work (BERT appends 4 special tokens);
- `datasets(plan)`: the train and valid datasets, sized for the whole run (`steps x
  global_batch` and `eval_batches x global_batch` samples), deterministic in the sample index:
  item i is a dict of tensors, each with the same leading shape for every i, holding at least
  `tokens` and `labels`;
- `split_batch(batch)`: a batch (the items' tensors stacked, rows first, on the device) as
  `(inputs, labels, extra)`: the first stage's positional input, the loss targets for the last
  stage, and per-row keyword tensors given to EVERY stage (`model(inputs, labels, **extra)`
  in one stage; `pipeline.pipeline_step(..., extra=extra)` across stages, which splits them
  into micro-batches with the rows);
- `pipeline_loss(model_config, groups)`: the pipeline schedule's loss function of the last
  stage's output (`local_logits=True`) and the labels, the mean of one micro-batch;
- `evaluate(model, documents, seq_len, batch, max_windows)`: what `tessera evaluate` reports
  for a single-process model over token documents (GPT: loss and perplexity; BERT: masked-LM
  loss, perplexity and accuracy), a dict with at least `loss` and `tokens`;
- `embedding_sync(plan, groups, stages)` (None: `pipeline.sync_tied_embedding_grads` is
  enough): made once at setup, collective over the world; returns the per-step gradient sync
  of embedding copies that the stages hold beyond the tied pair (T5);
- `pipeline_eval_loss(schedule, stages, inputs, labels, extra)` (None: `pipeline_forward`,
  which passes one hidden tensor between stages): the validation loss of one batch through
  the training schedule run forward only, on the last stage's rank (None elsewhere);
- `print_samples(checkpoint)`: what the demo prints from its final checkpoint (T5: span
  fills; None: the demo's greedy continuations, `training.demo.print_samples`).

A model's forward with labels must return the mean loss of its micro-batch (the loop averages
micro-batches and data-parallel ranks), and without labels its output (logits) for evaluation.

GPT ("causal-lm") is the identity of what the loop always did: packed windows, `tokens` in,
`labels` out, no extra inputs. BERT ("masked-lm") adds token types and the padding mask as
extra inputs. T5 ("span-corruption", `training.t5_objective`) feeds the encoder ids to the
first stage and the decoder input and encoder mask to every stage. A model family names its
objective (`core.models.family.Family.objective`); a family's own objective lives in its
training module (`training.bert_objective`, `training.t5_objective`), named by one line of
`_FAMILY_OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.core.config import ConfigError, ModelConfig, packed_attention_problems
from tessera.core.models.family import import_named
from tessera.core.models.registry import family as model_family

if TYPE_CHECKING:
    from tessera.training.run_plan import RunPlan

Batch = dict[str, torch.Tensor]
Split = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _default_pipeline_loss(config: ModelConfig, groups: Any) -> Callable:
    from tessera.core.parallel.pipeline import pipeline_loss_fn

    return pipeline_loss_fn(config, groups)


def _gpt_evaluate(*args: Any) -> dict[str, float]:
    from tessera.training.evaluate import evaluate

    return evaluate(*args)


@dataclass(frozen=True)
class Objective:
    """One family's part of pretraining; see the module docstring for each member's contract."""

    name: str
    problems: Callable[[RunPlan], list[str]]
    model_vocab: Callable[[int, int | None], int]
    datasets: Callable[[RunPlan], tuple[Any, Any]]
    split_batch: Callable[[Batch], Split]
    pipeline_loss: Callable[[ModelConfig, Any], Callable] = _default_pipeline_loss
    evaluate: Callable[..., dict[str, float]] = _gpt_evaluate
    embedding_sync: Callable[[RunPlan, Any, list], Callable[[], None]] | None = None
    pipeline_eval_loss: Callable[..., torch.Tensor | None] | None = None
    print_samples: Callable[[str], None] | None = None


# ------------------------------------------------------------------------------ causal LM


def _gpt_datasets(plan: RunPlan) -> tuple[Any, Any]:
    from tessera.training.gpt_dataset import build_datasets

    d = plan.data
    train_ds, valid_ds, _ = build_datasets(
        list(d.data), d.seq_len, d.split, [d.train_samples, d.valid_samples, 0], d.seed,
        d.data_cache or None)
    return train_ds, valid_ds


def _causal_lm_problems(plan: RunPlan) -> list[str]:
    """Isolated documents run the packed-document attention, which not every model can use."""
    if not plan.data.isolate_documents:
        return []
    return packed_attention_problems(plan.model, "--isolate-documents", "train without it")


CAUSAL_LM = Objective(
    name="causal-lm",
    problems=_causal_lm_problems,
    model_vocab=lambda data_vocab, set_vocab: data_vocab,
    datasets=_gpt_datasets,
    split_batch=lambda batch: (batch["tokens"], batch["labels"], {}),
)


# Objectives of the other families, each in its family's training module (imported on first
# use, as `core.models.registry` does for the families): name -> "module:attribute".
_FAMILY_OBJECTIVES: dict[str, str] = {
    "masked-lm": "tessera.training.bert_objective:MASKED_LM",
    "span-corruption": "tessera.training.t5_objective:SPAN_CORRUPTION",
}


def objective_named(name: str) -> Objective:
    """The `Objective` called `name` (raises `ConfigError` for an unknown one)."""
    if name == CAUSAL_LM.name:
        return CAUSAL_LM
    if name not in _FAMILY_OBJECTIVES:
        raise ConfigError(f"unknown pretraining objective {name!r}; known: "
                          f"{', '.join([CAUSAL_LM.name, *_FAMILY_OBJECTIVES])}")
    return import_named(_FAMILY_OBJECTIVES[name])


def objective_for(config: ModelConfig) -> Objective:
    """The pretraining objective that `config`'s family names (`Family.objective`)."""
    return objective_named(model_family(config).objective)


def check_objective(plan: RunPlan) -> None:
    """Raise `ConfigError` listing what the model's family cannot do with this plan."""
    objective = objective_for(plan.model)
    problems = objective.problems(plan)
    if problems:
        raise ConfigError(f"the {plan.model.family} model ({objective.name} pretraining) "
                          "cannot run this configuration:\n  - " + "\n  - ".join(problems))


def require_decoder(config: ModelConfig, what: str) -> None:
    """Raise `ConfigError` when `what` (a decoder-only feature) is asked of a non-decoder."""
    if objective_for(config).name != "causal-lm":
        raise ConfigError(f"{what} needs a decoder (GPT-style) model, but this is a "
                          f"{config.family} model ({objective_for(config).name})")
