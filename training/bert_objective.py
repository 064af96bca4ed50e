"""BERT's part of pretraining (masked LM): what it cannot take, its vocabulary (4 special
tokens appended), its datasets of `[CLS] A [SEP] B [SEP]` pairs, and the token types and padding
mask every stage gets (`training.objectives` states each member's contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.training.objectives import Batch, Objective, Split

if TYPE_CHECKING:
    from tessera.training.run_plan import RunPlan


def _bert_evaluate(*args: Any) -> dict[str, float]:
    from tessera.training.evaluate_mlm import evaluate_masked_lm

    return evaluate_masked_lm(*args)


def _bert_problems(plan: RunPlan) -> list[str]:
    out = []
    if plan.layout.cp > 1:
        out.append(f"--cp {plan.layout.cp}: context parallelism splits causal attention; a "
                   "BERT encoder attends both ways and runs with --cp 1 (use --tp/--pp/--dp)")
    if plan.data.isolate_documents:
        out.append("--isolate-documents is for packed decoder samples; BERT samples are "
                   "[CLS] A [SEP] B [SEP] pairs with their own padding mask: leave it off")
    if plan.model.options.binary_head and plan.layout.pp > 1:
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
        d.seed, d.data_cache or None, MaskingConfig(nsp=plan.model.options.binary_head))
    return train_ds, valid_ds


def _bert_split(batch: Batch) -> Split:
    extra = {"token_types": batch["token_types"], "attention_mask": batch["attention_mask"]}
    if "next_sentence" in batch:
        extra["next_sentence"] = batch["next_sentence"]
    return batch["tokens"], batch["labels"], extra


MASKED_LM = Objective(name="masked-lm", problems=_bert_problems, model_vocab=_bert_vocab,
                      datasets=_bert_datasets, split_batch=_bert_split, evaluate=_bert_evaluate)
