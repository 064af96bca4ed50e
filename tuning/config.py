"""The `tessera tune` configuration: YAML file plus `--key value` overrides, like pretraining.

Sections: `tune` (`TuneConfig`: base checkpoint, data, method, virtual tokens, encoder), and the
pretraining sections `train` (optimizer, schedule, steps, batch, precision), `parallel` (tp, pp,
dp) and `loop` (output, intervals, checkpoints) reused as they are, with tuning's own defaults.
A top-level `tasks:` mapping in the YAML gives per-task templates:

    tasks:
      sentiment:
        template: "Review: {review} Sentiment: {label}"
        answer_field: label
        truncate_field: review
        virtual_tokens: 20
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.core.arg_types import (
    fraction_below_one,
    non_negative_int,
    positive_float,
    positive_int,
)
from tessera.core.config import ConfigError, ModelConfig
from tessera.core.help import HelpFormatter
from tessera.training.config import (
    LoopConfig,
    ParallelSection,
    TrainConfig,
    add_section_flags,
    check_launcher_flags,
    check_lr_range,
    opt,
    read_yaml,
    section_values,
)

if TYPE_CHECKING:  # the task data module imports torch; --help should not
    from tessera.tuning.data import TaskSpec

METHODS = ("prompt-tuning", "p-tuning", "lora", "full", "dpo")
DPO_LOSSES = ("sigmoid", "ipo", "robust")
ENCODERS = ("mlp", "lstm")
INITS = ("vocab", "text")


@dataclass(frozen=True)
class TuneConfig:
    checkpoint: str = opt("", "the frozen base model: a Tessera checkpoint directory")
    data: str = opt("", "training (or, with --evaluate, evaluation) examples: JSONL, one "
                        '{"task": NAME, FIELD: text, ...} per line')
    valid: str = opt("", "validation examples in the same format: answer loss and exact match")
    method: str = opt("p-tuning", "prompt-tuning (learn the virtual embeddings) | p-tuning "
                                  "(learn them through an encoder, baked into a table at the end) "
                                  "| lora (learn low-rank updates B A of chosen linear layers, "
                                  "written as an adapter directory OUTPUT/adapter) | full "
                                  "(train every weight, written as a checkpoint OUTPUT/model) | dpo "
                                  "(preference pairs; --dpo-weights says what learns)")
    virtual_tokens: int = opt(10, "virtual tokens per task (a task in the YAML may set its own)",
                              range=positive_int)
    encoder: str = opt("mlp", "p-tuning encoder: mlp | lstm (bidirectional, then an MLP head)")
    encoder_hidden: int = opt(0, "p-tuning encoder width (0: the model's hidden size)",
                              range=non_negative_int)
    init: str = opt("vocab", "prompt-tuning start: vocab (embeddings of random vocabulary "
                             "tokens) | text (the embeddings of --init-text, tiled)")
    init_text: str = opt("", "with --init text: the text whose token embeddings start the prompt")
    add_eos: bool = opt(True, "end every answer with EOS, so generation stops after it")
    chat_template: str = opt("", "conversations ({\"messages\": [...]} rows): a Jinja chat "
                                 "template file (default: the base checkpoint's, the one "
                                 "tessera serve uses)")
    all_tokens: bool = opt(False, "conversations: train on every token, not only on the "
                                  "assistant's turns")
    eval_engine: bool = opt(False, "with --valid: generate the held-out answers (a "
                                   "conversation's last assistant turn) through the engine "
                                   "tessera serve runs, with the adapter merged; one process, "
                                   "LoRA or full")
    dpo_weights: str = opt("lora", "DPO: what learns, lora (the reference is the base with the "
                                   "adapter off) | full (the reference is a frozen copy)")
    dpo_beta: float = opt(0.1, "DPO: beta, how far the policy may move from the reference",
                          range=positive_float)
    dpo_loss: str = opt("sigmoid", "DPO: sigmoid | ipo | robust (TRL's definitions)")
    dpo_label_smoothing: float = opt(0.0, "DPO: the share of pairs assumed mislabelled "
                                          "(sigmoid: cDPO; robust)", range=fraction_below_one)
    pack: bool = opt(False, "pack several examples into each row, each its own document "
                            "(positions restart, no attention across examples); LoRA or full")
    lora_rank: int = opt(8, "LoRA: rank r of each adapted layer's update B A", range=positive_int)
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by alpha / rank",
                            range=positive_float)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapter's input while training",
                              range=fraction_below_one)
    lora_targets: str = opt("attention", "LoRA: the layers to adapt, comma-separated: qkv, wo, "
                                         "w1, w2 (in every layer), attention (qkv,wo), mlp "
                                         "(w1,w2), all, or a regular expression matched against "
                                         "the whole module name or the name after `layers.N.` "
                                         r"(e.g. 'layers\.[01]\.attention\.wqkv')")


# Tuning's defaults for the reused sections (the dataclass defaults are pretraining's).
# min_lr is left to follow lr (a tenth of it: 3e-3 with the default lr).
TRAIN_DEFAULTS = dict(steps=200, global_batch=16, seq_len=0, lr=3e-2,
                      warmup_steps=10, weight_decay=0.0, precision="fp32")
LOOP_DEFAULTS = dict(output="runs/tune", log_interval=20, eval_interval=50, eval_batches=0,
                     save_interval=100)
# Tuning's own flag ranges for reused fields: --seq-len 0 means the model's context.
RANGES = {"seq_len": non_negative_int}
SECTIONS: dict[str, type] = {"tune": TuneConfig, "train": TrainConfig,
                             "parallel": ParallelSection, "loop": LoopConfig}


@dataclass
class TuneRunConfig:
    """What `tessera tune` was asked to run, as written (YAML, then flags). The model comes
    from the base checkpoint; `training.run_plan.resolve_plan` makes the run's plan."""

    tune: TuneConfig = field(default_factory=TuneConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**TRAIN_DEFAULTS))
    parallel: ParallelSection = field(default_factory=ParallelSection)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(**LOOP_DEFAULTS))
    tasks: dict[str, TaskSpec] = field(default_factory=dict)  # from the YAML `tasks:` mapping
    model: ModelConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        out["tasks"] = {name: spec.to_dict() for name, spec in self.tasks.items()}
        return out

    def validate(self) -> None:
        """Raise `ConfigError` for choices that cannot work, all of them at once."""
        t, problems = self.tune, []
        if t.method not in METHODS:
            problems.append(f"unknown method {t.method!r}; use {' or '.join(METHODS)}")
        if t.encoder not in ENCODERS:
            problems.append(f"unknown encoder {t.encoder!r}; use {' or '.join(ENCODERS)}")
        if t.init not in INITS:
            problems.append(f"unknown init {t.init!r}; use {' or '.join(INITS)}")
        if t.init == "text" and not t.init_text:
            problems.append("--init text needs --init-text TEXT")
        if t.virtual_tokens < 1:
            problems.append(f"virtual_tokens must be >= 1, got {t.virtual_tokens}")
        if t.method == "dpo":
            if t.dpo_weights not in ("lora", "full"):
                problems.append(f"unknown --dpo-weights {t.dpo_weights!r}; use lora or full")
            if t.dpo_loss not in DPO_LOSSES:
                problems.append(f"unknown --dpo-loss {t.dpo_loss!r}; use {', '.join(DPO_LOSSES)}")
            if t.dpo_loss == "robust" and t.dpo_label_smoothing >= 0.5:
                problems.append("--dpo-loss robust needs --dpo-label-smoothing below 0.5")
            if t.pack:
                problems.append("--pack is for supervised tuning; DPO rows are pairs")
        if t.method == "lora" or (t.method == "dpo" and t.dpo_weights == "lora"):
            if t.lora_rank < 1:
                problems.append(f"lora_rank must be >= 1, got {t.lora_rank}")
            if not t.lora_alpha > 0:
                problems.append(f"lora_alpha must be > 0, got {t.lora_alpha}")
            if not 0.0 <= t.lora_dropout < 1.0:
                problems.append(f"lora_dropout must be in [0, 1), got {t.lora_dropout}")
            if not t.lora_targets.strip(" ,"):
                problems.append("lora_targets is empty; e.g. --lora-targets qkv,wo or all")
        if t.pack and t.method not in ("lora", "full"):
            problems.append("--pack needs --method lora or full (virtual tokens sit at the "
                            "start of each row, so prompt-tuned rows hold one example each)")
        if self.parallel.train_schedule().cp_dynamic and t.pack:
            problems.append("--pack runs with fixed --cp (drop --cp-dynamic)")
        if t.eval_engine:
            p = self.parallel
            if t.method not in ("lora", "full"):
                problems.append("--eval-engine needs --method lora or full (the engine serves "
                                "prompt tables from a saved table, not a training run)")
            if (p.tp, p.pp, p.cp, p.dp) != (1, 1, 1, 1):
                problems.append("--eval-engine runs in one process: drop --tp/--pp/--cp/--dp "
                                "(or evaluate the saved adapter with tessera serve)")
        if t.encoder_hidden < 0:
            problems.append(f"encoder_hidden must be >= 0, got {t.encoder_hidden}")
        if self.train.seq_len < 0:
            problems.append(f"seq_len must be >= 0 (0: the model's context), got "
                            f"{self.train.seq_len}")
        try:
            check_lr_range(self.train)
        except ConfigError as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError("invalid tuning configuration:\n  - " + "\n  - ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera tune", formatter_class=HelpFormatter,
        description="Prompt tuning / p-tuning / LoRA of a frozen model: learn a few virtual "
        "token embeddings per task, written as a prompt table (prompts.safetensors + "
        "prompts.json) that the server loads, or low-rank updates of chosen layers, written as "
        "a LoRA adapter directory (OUTPUT/adapter). Fields come from --config YAML, then "
        "flags; a flag can be bare (--lr) or dotted (--train.lr).",
        epilog="examples:\n"
        "  tessera tune --checkpoint BASE --data train.jsonl --valid valid.jsonl \\\n"
        "      --method p-tuning --virtual-tokens 10 --output runs/tune\n"
        "  tessera tune --evaluate --prompts runs/tune --data test.jsonl\n"
        "  tessera tune --checkpoint BASE --data train.jsonl --valid valid.jsonl --method lora \\\n"
        "      --lora-rank 8 --lora-alpha 16 --lora-targets qkv,wo --lr 1e-3 --output runs/lora\n"
        "  tessera tune --evaluate --adapter runs/lora/adapter --data test.jsonl\n"
        "  tessera tune --merge runs/lora/adapter --checkpoint BASE --output merged/\n"
        "  tessera tune --export peft --prompts runs/tune --output adapters/\n"
        "  tessera tune --import-peft ADAPTER --checkpoint BASE --task NAME --output DIR\n"
        "  tessera tune --nproc-per-node 4 --tp 2 --pp 2 --config tune.yaml")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file with any of the fields below, and `tasks:`")
    parser.add_argument("--nproc-per-node", type=non_negative_int, default=0, metavar="N",
                        help="start this many local ranks with torch's launcher (torchrun) "
                        "(default: 0, this process only)")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                        help="with --nproc-per-node: when a rank fails, restart all of them up "
                        "to N times; they continue from the latest checkpoint (--resume auto) "
                        "(default: 0)")
    modes = parser.add_argument_group("other modes")
    modes.add_argument("--evaluate", action="store_true",
                       help="report answer loss and exact match of --prompts on --data; no "
                            "training")
    modes.add_argument("--prompts", metavar="DIR",
                       help="a prompt table directory (for --evaluate and --export)")
    modes.add_argument("--export", choices=["peft"],
                       help="write PEFT prompt-tuning adapters (OUTPUT/TASK/), from --prompts, "
                            "or after training")
    modes.add_argument("--import-peft", metavar="ADAPTER_DIR",
                       help="turn a PEFT prompt-tuning adapter into a prompt table for "
                            "--checkpoint (needs --task and --output)")
    modes.add_argument("--adapter", metavar="DIR",
                       help="a LoRA adapter directory (for --evaluate)")
    modes.add_argument("--merge", metavar="ADAPTER_DIR",
                       help="write --output as a full checkpoint of --checkpoint (default: the "
                            "adapter's base) with the LoRA adapter folded into its weights, in "
                            "the layout of --tp / --pp (run with --nproc-per-node tp*pp)")
    modes.add_argument("--task", help="with --import-peft: the task name; with --export: only "
                                      "this task")
    add_section_flags(parser, SECTIONS, TuneRunConfig(), RANGES)
    return parser


def load_config(argv: list[str]) -> tuple[TuneRunConfig, argparse.Namespace]:
    """Parse argv (YAML first, flags win) into a `TuneRunConfig`; errors name the bad key."""
    args = build_parser().parse_args(argv)
    check_launcher_flags(args)
    raw = read_yaml(args.config)
    tasks_raw = raw.pop("tasks", None)
    config = TuneRunConfig()
    for section, values in section_values(raw, args, SECTIONS, args.config, RANGES).items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    from tessera.tuning.data import task_specs_from_yaml

    config.tasks = task_specs_from_yaml(tasks_raw, args.config)
    config.validate()
    return config, args
