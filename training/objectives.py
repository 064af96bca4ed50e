"""Pretraining objectives: what a model family brings to the pretraining loop.

The loop (`training.loop`) is written once for every family. What differs between them is
gathered in one `Objective`, picked by the model's family (`objective_for`):

- `problems(cfg)`: the settings this family cannot take, each a message that says what to do
  (BERT: context parallelism, isolated documents, a next-sentence head in a pipeline);
- `model_vocab(data_vocab, set_vocab)`: the model vocabulary for a tokenizer (or data) of
  `data_vocab` tokens; `set_vocab` is the user's explicit `vocab_size` or None. It raises
  ValueError when the explicit one cannot work (BERT appends 4 special tokens);
- `datasets(cfg)`: the train and valid datasets, sized for the whole run (`steps x
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
  loss, perplexity and accuracy), a dict with at least `loss` and `tokens`.

A model's forward with labels must return the mean loss of its micro-batch (the loop averages
micro-batches and data-parallel ranks), and without labels its output (logits) for evaluation.

GPT ("causal-lm") is the identity of what the loop always did: packed windows, `tokens` in,
`labels` out, no extra inputs. BERT ("masked-lm") adds token types and the padding mask as
extra inputs. T5 ("span-corruption", `training.t5_objective`) feeds the encoder ids to the
first stage and the decoder input and encoder mask to every stage. A new family registers one
`Objective` in `OBJECTIVES` and its family in `FAMILY_OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.core.config import ConfigError, ModelConfig
from tessera.training import t5_objective as t5

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


def _bert_evaluate(*args: Any) -> dict[str, float]:
    from tessera.training.evaluate_mlm import evaluate_masked_lm

    return evaluate_masked_lm(*args)


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


# ------------------------------------------------------------------------------ causal LM


def _gpt_datasets(plan: RunPlan) -> tuple[Any, Any]:
    from tessera.training.gpt_dataset import build_datasets

    d = plan.data
    train_ds, valid_ds, _ = build_datasets(
        list(d.data), d.seq_len, d.split, [d.train_samples, d.valid_samples, 0], d.seed,
        d.data_cache or None)
    return train_ds, valid_ds


CAUSAL_LM = Objective(
    name="causal-lm",
    problems=lambda plan: [],
    model_vocab=lambda data_vocab, set_vocab: data_vocab,
    datasets=_gpt_datasets,
    split_batch=lambda batch: (batch["tokens"], batch["labels"], {}),
)


# ------------------------------------------------------------------------------ masked LM


def _bert_problems(plan: RunPlan) -> list[str]:
    out = []
    if plan.layout.cp > 1:
        out.append(f"--cp {plan.layout.cp}: context parallelism splits causal attention; a "
                   "BERT encoder attends both ways and runs with --cp 1 (use --tp/--pp/--dp)")
    if plan.data.isolate_documents:
        out.append("--isolate-documents is for packed decoder samples; BERT samples are "
                   "[CLS] A [SEP] B [SEP] pairs with their own padding mask: leave it off")
    if plan.model.binary_head and plan.layout.pp > 1:
        out.append("the next-sentence head (binary_head=true) runs only without pipeline "
                   "parallelism (pp 1); set binary_head=false or --pp 1")
    return out


def _bert_vocab(data_vocab: int, set_vocab: int | None) -> int:
    from tessera.training.bert_dataset import bert_specials

    return bert_specials(data_vocab, set_vocab).vocab_size


def _bert_datasets(plan: RunPlan) -> tuple[Any, Any]:
    from tessera.training.bert_dataset import BertSpecials, MaskingConfig, build_bert_datasets

    d = plan.data
    specials = BertSpecials.of_model(plan.model.vocab_size)  # `model_vocab` made room
    train_ds, valid_ds, _ = build_bert_datasets(
        list(d.data), d.seq_len, d.split, [d.train_samples, d.valid_samples, 0], specials,
        d.seed, d.data_cache or None, MaskingConfig(nsp=plan.model.binary_head))
    return train_ds, valid_ds


def _bert_split(batch: Batch) -> Split:
    extra = {"token_types": batch["token_types"], "attention_mask": batch["attention_mask"]}
    if "next_sentence" in batch:
        extra["next_sentence"] = batch["next_sentence"]
    return batch["tokens"], batch["labels"], extra


MASKED_LM = Objective(name="masked-lm", problems=_bert_problems, model_vocab=_bert_vocab,
                      datasets=_bert_datasets, split_batch=_bert_split, evaluate=_bert_evaluate)


# ------------------------------------------------------------------------------ span corruption


SPAN_CORRUPTION = Objective(name="span-corruption", problems=t5.problems,  # T5
                            model_vocab=t5.model_vocab, datasets=t5.datasets,
                            split_batch=t5.split_batch, evaluate=t5.evaluate)


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (CAUSAL_LM, MASKED_LM, SPAN_CORRUPTION)}
FAMILY_OBJECTIVES: dict[str, str] = {"bert": "masked-lm",  # every other family: causal-lm
                                     "t5": "span-corruption"}


def objective_for(config: ModelConfig) -> Objective:
    """The pretraining objective of `config`'s family."""
    return OBJECTIVES[FAMILY_OBJECTIVES.get(config.family, "causal-lm")]


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
