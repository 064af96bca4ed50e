"""BERT's part of pretraining (masked LM): what it cannot take, its vocabulary (4 special
tokens appended), its datasets of `[CLS] A [SEP] B [SEP]` pairs, and the token types and padding
mask every stage gets (`training.objectives` states each member's contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.training.objectives import Batch, Objective, Split

if TYPE_CHECKING:
    from tessera.training.config import PretrainConfig


def _bert_evaluate(*args: Any) -> dict[str, float]:
    from tessera.training.evaluate_mlm import evaluate_masked_lm

    return evaluate_masked_lm(*args)


def _bert_problems(cfg: PretrainConfig) -> list[str]:
    out = []
    if cfg.parallel.cp > 1:
        out.append(f"--cp {cfg.parallel.cp}: context parallelism splits causal attention; a "
                   "BERT encoder attends both ways and runs with --cp 1 (use --tp/--pp/--dp)")
    if cfg.data.isolate_documents:
        out.append("--isolate-documents is for packed decoder samples; BERT samples are "
                   "[CLS] A [SEP] B [SEP] pairs with their own padding mask: leave it off")
    if cfg.model.options.binary_head and cfg.parallel.pp > 1:
        out.append("the next-sentence head (binary_head=true) runs only without pipeline "
                   "parallelism (pp 1); set binary_head=false or --pp 1")
    return out


def _bert_vocab(data_vocab: int, set_vocab: int | None) -> int:
    from tessera.training.bert_dataset import bert_specials

    return bert_specials(data_vocab, set_vocab).vocab_size


def _bert_datasets(cfg: PretrainConfig) -> tuple[Any, Any]:
    from tessera.training.bert_dataset import BertSpecials, MaskingConfig, build_bert_datasets

    t = cfg.train
    specials = BertSpecials.of_model(cfg.model.vocab_size)  # `model_vocab` made room
    train_ds, valid_ds, _ = build_bert_datasets(
        cfg.data.data, t.seq_len, cfg.data.split,
        [t.steps * t.global_batch, cfg.loop.eval_batches * t.global_batch, 0], specials,
        t.seed, cfg.data.data_cache or None, MaskingConfig(nsp=cfg.model.options.binary_head))
    return train_ds, valid_ds


def _bert_split(batch: Batch) -> Split:
    extra = {"token_types": batch["token_types"], "attention_mask": batch["attention_mask"]}
    if "next_sentence" in batch:
        extra["next_sentence"] = batch["next_sentence"]
    return batch["tokens"], batch["labels"], extra


MASKED_LM = Objective(name="masked-lm", problems=_bert_problems, model_vocab=_bert_vocab,
                      datasets=_bert_datasets, split_batch=_bert_split, evaluate=_bert_evaluate)
