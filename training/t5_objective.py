"""T5's part of pretraining (`SPAN_CORRUPTION`, see `training.objectives`): span-corruption batches.

A sample is `training.t5_data.T5SpanDataset`'s: `seq_len` encoder tokens (`--seq-len` is the
encoder length; the target length follows from it), the decoder input and the labels. The
tokenizer's vocabulary gets `DEFAULT_SENTINELS` (100, as T5) sentinel ids right above its own
pieces, so the model's vocabulary is the tokenizer's + 100 unless `vocab_size` is set, and then
it must hold them. In the loop, the encoder ids are the first stage's positional input, the
labels the last stage's targets, and `decoder_input_ids` / `encoder_mask` the keywords every
stage gets (`core.models.t5.model.T5Model.forward`).

The step's loss is, as for GPT and as Megatron computes T5's, the mean over micro-batches (and
data-parallel ranks) of each micro-batch's mean over its labels. T5 targets differ in length,
so that loss depends on the rows per micro-batch (`global_batch / (dp x micro_batches)`): a
run follows the one-process curve of the same rows per micro-batch (tp and pp change nothing;
dp 2 x 2 micro-batches equals one process with 4).

What T5 cannot take here (`problems`): context parallelism and isolated documents (decoder-only
packing), virtual pipeline stages, activation recomputation, FP8, and data without a tokenizer
(the sentinels sit above the tokenizer's pieces and the EOS id comes from it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tessera.core.models.t5.layout import T5_RECOMPUTE, T5_REFUSED_PRECISIONS
from tessera.core.models.t5.tokens import DEFAULT_SENTINELS
from tessera.training.objectives import Objective

if TYPE_CHECKING:
    from tessera.training.run_plan import RunPlan

Batch = dict[str, torch.Tensor]


def problems(plan: RunPlan) -> list[str]:
    """The settings T5 pretraining cannot run, each saying what to do instead."""
    layout, out = plan.layout, []
    if layout.cp > 1 or plan.schedule.cp_dynamic:
        out.append(f"--cp {layout.cp}: context parallelism splits a decoder-only sequence; T5 runs "
                   "with --cp 1 (use --tp/--pp/--dp)")
    if plan.data.isolate_documents:
        out.append("--isolate-documents is for packed decoder samples; T5 samples are span-"
                   "corrupted encoder inputs with their own padding mask: leave it off")
    if layout.virtual_stages > 1:
        out.append(f"--virtual-stages {layout.virtual_stages}: T5 runs one pipeline stage per rank "
                   "(the encoder/decoder split); use --virtual-stages 1")
    if plan.schedule.recompute not in T5_RECOMPUTE:
        out.append(f"--recompute {plan.schedule.recompute}: T5 runs without activation recomputation; "
                   "use --recompute none")
    if plan.precision.name in T5_REFUSED_PRECISIONS:
        out.append("--precision fp8 covers the decoder-only blocks; train T5 in fp32, bf16, "
                   "bf16-pure or fp16")
    if not plan.data.tokenizer:
        out.append("T5 span corruption puts its sentinel tokens above the tokenizer's pieces "
                   "and ends samples with its EOS: pass --tokenizer (the one the data was made "
                   "with)")
    return out


def model_vocab(data_vocab: int, set_vocab: int | None) -> int:
    """The tokenizer's vocabulary + the sentinels; an explicit `set_vocab` must hold them."""
    need = data_vocab + DEFAULT_SENTINELS
    if set_vocab is None:
        return need
    if set_vocab < need:
        raise ValueError(
            f"the model's vocab_size {set_vocab} has no room for T5's {DEFAULT_SENTINELS} "
            f"sentinel tokens above the tokenizer's {data_vocab} pieces (ids up to {need - 1}): "
            f"set vocab_size to at least {need}, or leave it out so that it follows")
    return set_vocab


def datasets(plan: RunPlan) -> tuple[Any, Any]:
    """The train and valid span-corruption datasets, sized for the whole run."""
    from tessera.core.models.t5.tokens import SentinelTokenizer
    from tessera.core.tokenizer import load_tokenizer
    from tessera.training.t5_data import build_t5_datasets

    d = plan.data
    tokenizer = SentinelTokenizer(load_tokenizer(d.tokenizer), DEFAULT_SENTINELS)
    train_ds, valid_ds, _ = build_t5_datasets(
        list(d.data), tokenizer, d.seq_len, d.split, [d.train_samples, d.valid_samples, 0],
        d.seed, d.data_cache or None, plan.model.vocab_size)
    if plan.layout.sequence_parallel and plan.layout.tp > 1:
        # Sequence parallelism splits the decoder's tokens over tp: the target length (from
        # seq_len, e.g. 9 for 32) is padded up to a multiple of tp with ignored positions. The
        # decoder is causal and the padding is never a label, so the loss stays the same.
        train_ds, valid_ds = (None if ds is None else PaddedTargets(ds, plan.layout.tp,
                                                                    tokenizer.pad_id)
                              for ds in (train_ds, valid_ds))
    return train_ds, valid_ds


class PaddedTargets:
    """`dataset`'s samples with `labels` (-100) and `decoder_input_ids` (`pad_id`) padded at
    the end to a multiple of `multiple` tokens."""

    def __init__(self, dataset: Any, multiple: int, pad_id: int):
        self.inner, self.multiple, self.pad_id = dataset, multiple, pad_id
        self.datasets = getattr(dataset, "datasets", None) or [dataset]  # for the banner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Batch:
        item = dict(self.inner[i])
        extra = -item["labels"].shape[0] % self.multiple
        if extra:
            pad = torch.nn.functional.pad
            item["labels"] = pad(item["labels"], (0, extra), value=-100)
            item["decoder_input_ids"] = pad(item["decoder_input_ids"], (0, extra),
                                            value=self.pad_id)
        return item


def split_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Batch]:
    """(encoder ids, labels, the decoder input and encoder mask for every stage)."""
    extra = {"decoder_input_ids": batch["decoder_input_ids"],
             "encoder_mask": batch["encoder_mask"]}
    return batch["encoder_ids"], batch["labels"], extra


def evaluate(model: Any, documents: Any, seq_len: int, batch: int = 8,
             max_windows: int | None = None, **kw: Any) -> dict[str, float]:
    """`tessera evaluate`'s span-corruption loss and accuracy (`training.evaluate_t5`)."""
    from tessera.training.evaluate_t5 import evaluate_span_corruption

    return evaluate_span_corruption(model, documents, seq_len, batch, max_windows, **kw)


def _print_samples(checkpoint: str) -> None:
    from tessera.training.t5_demo import print_t5_samples  # span fills, not continuations

    print_t5_samples(checkpoint)


def _embedding_sync(plan: RunPlan, groups: Any, stages: list) -> Callable[[], None]:
    from tessera.training.t5_loop import t5_embedding_sync

    return t5_embedding_sync(plan, groups, stages)


def _pipeline_eval_loss(*args: Any) -> torch.Tensor | None:
    from tessera.training.t5_loop import t5_pipeline_eval_loss

    return t5_pipeline_eval_loss(*args)


SPAN_CORRUPTION = Objective(name="span-corruption", problems=problems, model_vocab=model_vocab,
                            datasets=datasets, split_batch=split_batch, evaluate=evaluate,
                            embedding_sync=_embedding_sync,
                            pipeline_eval_loss=_pipeline_eval_loss, print_samples=_print_samples)
