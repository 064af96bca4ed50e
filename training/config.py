"""The pretraining run's configuration: YAML file plus `--key value` overrides, each field documented.

Sections are dataclasses (`TrainConfig`, `DataConfig`, `ParallelSection`, and the model as a
preset name plus `ModelConfig` overrides). Every field name is unique across sections, so a flag can be
written bare (`--lr 3e-4`, `--tp 2`) or dotted (`--train.lr 3e-4`); YAML takes the same names,
grouped by section or flat. `--help` lists every field with its default and meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tessera.core.config import (
    ConfigError,
    CPComm,
    DataParallel,
    Layout,
    ModelConfig,
    Recompute,
    TrainSchedule,
)
from tessera.core.field_values import coerce_field, str2bool
from tessera.core.help import HelpFormatter, with_default
from tessera.core.presets import DEFAULT_PRESET, model_from_spec


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its `--help` text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class TrainConfig:
    seed: int = opt(1234, "run seed: initialization, data order and dropout all derive from it")
    steps: int = opt(200, "optimizer steps to train for")
    global_batch: int = opt(16, "sequences per optimizer step, over all data-parallel ranks")
    seq_len: int = opt(128, "tokens per training sequence")
    lr: float = opt(3e-3, "peak learning rate")
    min_lr: float = opt(3e-4, "learning rate at the end of the decay")
    warmup_steps: int = opt(20, "linear warmup steps from 0 to lr")
    decay: str = opt("cosine", "decay after warmup: cosine | linear | constant")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only; not biases, norms)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip gradients to this global norm (0: off)")
    precision: str = opt("fp32", "fp32 | bf16 (fp32 master weights, bf16 compute) | "
                                 "bf16-pure (bf16 weights) | fp16 (with dynamic loss scaling) | "
                                 "fp8 (bf16, with the block linears in FP8; see --fp8-backend)")
    fp8_backend: str = opt("auto", "with --precision fp8: auto (CUDA: Transformer Engine, else "
                                   "torchao; CPU: emulated) | te | torchao | emulated")
    fp8_recipe: str = opt("auto", "with --precision fp8: auto (the backend's default) | delayed "
                                  "(amax history) | tensorwise (current scaling) | block | mxfp8 "
                                  "(TE) | rowwise | rowwise-gw-hp (torchao)")
    fp8_format: str = opt("hybrid", "hybrid (e4m3 forward, e5m2 gradients) | e4m3 (everywhere)")
    fp8_amax_history_len: int = opt(1024, "delayed scaling: steps of amax history kept")
    fp8_margin: int = opt(0, "delayed scaling: scales are divided by 2**margin")
    fp8_amax_compute_algo: str = opt("max", "delayed scaling: max (over the history) | "
                                            "most_recent")
    device: str = opt("auto", "auto | cpu | cuda")
    compile: bool = opt(False, "torch.compile each model chunk (costs 10-30 s once; on this "
                               "project's CPU bench bf16 steps ran ~1.4x faster)")
    peak_tflops: str = opt("auto", "peak TFLOP/s per device that MFU is reported against: a "
                                   "number, auto (the datasheet peak of a known CUDA GPU; else "
                                   "MFU is n/a) or measure (a matmul timed at start-up)")


@dataclass(frozen=True)
class DataConfig:
    data: list[str] = opt([], "indexed datasets: PREFIX, or weighted 0.7 PREFIX_A 0.3 PREFIX_B",
                          nargs="+")
    tokenizer: str = opt("", "tokenizer model (.model / tokenizer.json) saved with checkpoints")
    split: str = opt("98,1,1", "train,valid,test split of documents by ratio")
    data_cache: str = opt("", "where cached index arrays go (default: next to the data)")
    # Samples are always packed streams of documents (`tessera preprocess` appends EOD after
    # each); this decides whether a token may see the documents packed before it.
    isolate_documents: bool = opt(False, "packed samples: no token attends across an EOD "
                                          "(end of document) and positions restart after each; "
                                          "needs --tokenizer for the EOD id")


@dataclass(frozen=True)
class LoopConfig:
    output: str = opt("runs/pretrain", "run directory: checkpoints, metrics.jsonl, tensorboard/")
    log_interval: int = opt(10, "print a metrics line every N steps")
    eval_interval: int = opt(50, "validation loss/perplexity every N steps (0: only at the end)")
    eval_batches: int = opt(4, "validation batches per evaluation")
    save_interval: int = opt(100, "checkpoint every N steps (0: only at the end)")
    keep_last: int = opt(2, "checkpoints to keep (older ones are deleted)")
    resume: bool = opt(False, "continue from the latest complete checkpoint in output/")
    overwrite: bool = opt(False, "delete the run already in output/ (checkpoints, metrics) and "
                                 "start over; without it or --resume such a directory is refused")
    progress: bool = opt(True, "show a progress bar")
    tensorboard: bool = opt(True, "write TensorBoard events when tensorboard is installed")


@dataclass(frozen=True)
class ParallelSection:
    """The `parallel:` section (and its flags): the layout and the training schedule together,
    as the user writes them. `layout()` and `train_schedule()` split it into the core's `Layout`
    (placement: the one the schedule needs) and `TrainSchedule`."""

    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_comm: CPComm = "allgather"
    recompute: Recompute = "none"
    recompute_layers: int | None = None
    schedule: str = "1f1b"
    micro_batches: int = 1
    data_parallel: DataParallel = "ddp"
    # --- Expert parallelism (issue 14): MoE models only, folded over tp x cp x dp.
    ep: int = 1
    etp: int = 1
    # dynamic context parallelism
    cp_dynamic: bool = False
    # MoE token dispatcher under expert parallelism (issue 14)
    moe_dispatcher: str = "alltoall"

    def layout(self) -> Layout:
        from tessera.core.parallel.pipeline import split_layout_and_schedule

        return split_layout_and_schedule(dataclasses.asdict(self))[0]

    def train_schedule(self) -> TrainSchedule:
        from tessera.core.parallel.pipeline import split_layout_and_schedule

        return split_layout_and_schedule(dataclasses.asdict(self))[1]


@dataclass(frozen=True)
class PretrainConfig:
    """What `tessera pretrain` was asked to run, as written (YAML, then flags); never changed
    after parsing. `training.run_plan.resolve_plan` turns it into the run's plan."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig.from_name(DEFAULT_PRESET))
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    # The ModelConfig fields the user set (YAML `model:` mapping, --model-overrides), as opposed
    # to the preset's defaults: the vocabulary follows the tokenizer unless vocab_size is here.
    model_fields_set: frozenset[str] = field(default_factory=frozenset)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["model_fields_set"]  # how the config was written, not what it is
        return out


_PARALLEL_HELP = {
    "tp": "tensor-parallel size", "pp": "pipeline-parallel size (ranks)",
    "virtual_stages": "model chunks per pipeline rank (interleaved / V schedules)",
    "dp": "data-parallel size (default: world size / (tp x cp x pp))",
    "cp": "context-parallel size: each sequence split over cp ranks (seq_len a multiple of 2 x cp)",
    "cp_comm": "how attention reaches the other cp ranks' keys: allgather | ring",
    "sequence_parallel": "shard norm/dropout activations along the sequence over tp",
    "recompute": "activation recomputation: none | selective (core attention) | full",
    "recompute_layers": "with recompute full: the first N layers of each stage",
    "schedule": "pipeline schedule: 1f1b | interleaved-1f1b | zero-bubble | zbv | gpipe | ...",
    "micro_batches": "micro-batches per step (pipeline fill / gradient accumulation)",
    "data_parallel": "ddp | zero1 (optimizer state sharded over dp; with --ep / --etp, expert "
                     "state over the expert-data-parallel ranks) | fsdp (FSDP2: parameters too; "
                     "not with --ep / --etp)",
    "ep": "expert-parallel size (MoE models): the experts split over ep of the dp x cp ranks; "
          "adds no ranks",
    "etp": "expert-tensor-parallel size (MoE models): each expert's FFN split over etp ranks, "
           "set apart from tp; ep x etp must divide tp x cp x dp",
    "cp_dynamic": "per micro-batch, spread each sequence (packed document) over as few cp ranks "
                  "as its length needs (short ones stay whole on one rank) instead of all cp",
    "moe_dispatcher": "how MoE tokens reach the ranks holding their experts (ep x etp > 1): "
                      "alltoall | allgather",
}


# section name -> its dataclass: what `tessera pretrain` reads. Other verbs (`tessera tune`) pass
# their own mapping to `add_section_flags` / `section_values`, reusing sections from here.
SECTIONS: dict[str, type] = {"parallel": ParallelSection, "train": TrainConfig,
                             "data": DataConfig, "loop": LoopConfig}


def _type_of(f: dataclasses.Field, owner: type) -> Any:
    hints = typing.get_type_hints(owner)
    return hints[f.name]


def build_parser(prog: str = "tessera pretrain") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description="Pretrain a GPT-style model. With no arguments: the built-in demo (a corpus "
        "from the Python standard library's docstrings, a tokenizer, a small Llama on CPU, then "
        "a sample generation). Fields come from --config YAML, then flags; a flag can be bare "
        "(--lr) or dotted (--train.lr).",
        epilog="examples:\n  tessera pretrain --config run.yaml --lr 1e-3 --steps 500\n"
        "  tessera pretrain --data corpus_text --tokenizer tok.model --model llama-tiny\n"
        "  tessera pretrain --nproc-per-node 4 --tp 2 --pp 2   # the demo on 4 CPU ranks\n"
        "  torchrun --nproc-per-node 8 -m tessera pretrain --config run.yaml --tp 2 --pp 2\n"
        "  tessera pretrain --list-models")
    parser.add_argument("--config", metavar="FILE", help="YAML file with any of the fields below")
    parser.add_argument("--model", metavar="NAME",
                        help="model preset name, e.g. llama-tiny, gpt2-small; see --list-models "
                        "(default: llama-demo)")
    parser.add_argument("--model-overrides", metavar="K=V", nargs="+", default=[],
                        help="ModelConfig fields, e.g. num_layers=8 hidden_size=256")
    parser.add_argument("--list-models", action="store_true",
                        help="print the model presets with their sizes and exit")
    parser.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="start this many local ranks with torch's launcher (torchrun) "
                        "(default: 0, this process only)")
    parser.add_argument("--demo", action="store_true", help="run the built-in demo")
    add_section_flags(parser, SECTIONS, PretrainConfig())
    return parser


def add_section_flags(parser: argparse.ArgumentParser, sections: dict[str, type],
                      defaults: Any = None) -> None:
    """One flag per field of each section's dataclass, bare (`--lr`) and dotted (`--train.lr`).

    Values land in `args` as `SECTION.FIELD` only when given (`section_values` merges them).
    `--help` lists the bare flag with the field's default, taken from `defaults` (an object with
    one attribute per section, e.g. `PretrainConfig()`) or else from the dataclass; the dotted
    and underscore spellings work but are not listed again.
    """
    for section, owner in sections.items():
        group = parser.add_argument_group(section)
        values = getattr(defaults, section, None) or owner()
        for f in dataclasses.fields(owner):
            typ = _type_of(f, owner)
            help_ = f.metadata.get("help") or _PARALLEL_HELP.get(f.name, "")
            metavar = {int: "N", float: "X"}.get(typ, f.name.upper())
            kw: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS,
                                  "metavar": metavar}
            if typ is bool:
                kw.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
            elif f.metadata.get("nargs"):
                kw.update(nargs=f.metadata["nargs"])
            elif typ in (int, float, str):
                kw["type"] = typ
            elif f.name == "recompute_layers":
                kw.update(type=int, metavar="N")
            names = [f"--{f.name.replace('_', '-')}", f"--{section}.{f.name}"]
            if "_" in f.name:
                names.append(f"--{f.name}")
            group.add_argument(names[0], help=with_default(help_, getattr(values, f.name)), **kw)
            for alias in names[1:]:
                group.add_argument(alias, help=argparse.SUPPRESS, **kw)


def load_config(argv: list[str]) -> tuple[PretrainConfig, argparse.Namespace]:
    """Parse argv (YAML first, flags win) into a `PretrainConfig`; errors name the bad key."""
    args = build_parser().parse_args(argv)
    raw = read_yaml(args.config)
    model_spec = raw.pop("model", None)
    sections = {section: owner(**values) for (section, values), owner in
                zip(section_values(raw, args, SECTIONS, args.config).items(), SECTIONS.values())}
    model, fields_set = model_from_spec(model_spec, args.model, args.model_overrides)
    return PretrainConfig(model=model, model_fields_set=fields_set, **sections), args


def read_yaml(path: str | None) -> dict[str, Any]:
    """The top-level mapping of a YAML config file (empty without a file)."""
    if not path:
        return {}
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    raw = yaml.safe_load(file.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping of fields at the top level")
    return raw


def section_values(raw: dict[str, Any], args: argparse.Namespace, sections: dict[str, type],
                   source: str | None) -> dict[str, dict[str, Any]]:
    """Field values by section: YAML `raw` (grouped by section, or flat) first, then the flags
    in `args` (from `add_section_flags`). YAML values are coerced to their field's type; an
    unknown key is an error naming it (the caller pops its own non-section keys first)."""
    out: dict[str, dict[str, Any]] = {s: {} for s in sections}
    known = {f.name: s for s, owner in sections.items() for f in dataclasses.fields(owner)}
    hints = {s: typing.get_type_hints(owner) for s, owner in sections.items()}
    for key, value in raw.items():
        if key in sections and isinstance(value, dict):
            for k, v in value.items():
                if k not in known or known[k] != key:
                    raise ConfigError(f"{source}: unknown field {key}.{k}")
                out[key][k] = coerce_field(f"{source}: {key}.{k}", v, hints[key][k])
        elif key in known:  # a flat field (`data` is both a section and a field)
            out[known[key]][key] = coerce_field(f"{source}: {key}", value, hints[known[key]][key])
        elif key in sections:
            raise ConfigError(f"{source}: section {key!r} must be a mapping of fields, "
                              f"got {value!r}")
        else:
            raise ConfigError(f"{source}: unknown field {key!r}; see --help for the fields")
    for dest, value in vars(args).items():
        section, _, name = dest.partition(".")
        if name and section in out:
            out[section][name] = value
    return out
