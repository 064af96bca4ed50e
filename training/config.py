"""The pretraining run's configuration: YAML file plus `--key value` overrides, each field documented.

Sections are dataclasses (`TrainConfig`, `DataConfig`, `ParallelSection`, and the model as a
preset name plus `ModelConfig` overrides). Every field name is unique across sections, so a flag can be
written bare (`--lr 3e-4`, `--tp 2`) or dotted (`--train.lr 3e-4`); YAML takes the same names,
grouped by section or flat. `--help` lists every field with its default and meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from tessera.core.arg_types import (
    Bounded,
    fraction_below_one,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    resume_mode,
    str2bool,
)
from tessera.core.config import (
    ConfigError,
    CPComm,
    DataParallel,
    Layout,
    ModelConfig,
    Recompute,
    TrainSchedule,
)
from tessera.core.field_values import coerce_field
from tessera.core.help import HelpFormatter, with_default
from tessera.core.presets import DEFAULT_PRESET, model_from_spec


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field carrying its `--help` text (and, as `range=`, the `Bounded` range its
    flag and YAML value must lie in; as `parse=`, the function that reads its flag and YAML
    value, raising `argparse.ArgumentTypeError`, and as `const=`, the bare flag's value)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class TrainConfig:
    seed: int = opt(1234, "run seed: initialization, data order and dropout all derive from it",
                    range=non_negative_int)
    steps: int = opt(200, "optimizer steps to train for", range=positive_int)
    global_batch: int = opt(16, "sequences per optimizer step, over all data-parallel ranks",
                            range=positive_int)
    seq_len: int = opt(128, "tokens per training sequence", range=positive_int)
    lr: float = opt(3e-3, "peak learning rate", range=positive_float)
    min_lr: float | None = opt(None, "learning rate at the end of the decay, at most lr "
                                      "(default: lr / 10)", range=non_negative_float)
    warmup_steps: int = opt(20, "linear warmup steps from 0 to lr", range=non_negative_int)
    decay: str = opt("cosine", "decay after warmup: cosine | linear | constant")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only; not biases, norms)",
                              range=non_negative_float)
    beta1: float = opt(0.9, "AdamW beta1", range=fraction_below_one)
    beta2: float = opt(0.95, "AdamW beta2", range=fraction_below_one)
    adam_eps: float = opt(1e-8, "AdamW epsilon", range=positive_float)
    clip_grad: float = opt(1.0, "clip gradients to this global norm (0: off)",
                           range=non_negative_float)
    precision: str = opt("fp32", "fp32 | bf16 (fp32 master weights, bf16 compute) | "
                                 "bf16-pure (bf16 weights) | fp16 (with dynamic loss scaling) | "
                                 "fp8 (bf16, with the block linears in FP8; see --fp8-backend)")
    fp8_backend: str = opt("auto", "with --precision fp8: auto (CUDA: Transformer Engine, else "
                                   "torchao; CPU: emulated) | te | torchao | emulated")
    fp8_recipe: str = opt("auto", "with --precision fp8: auto (the backend's default) | delayed "
                                  "(amax history) | tensorwise (current scaling) | block | mxfp8 "
                                  "(TE) | rowwise (torchao, emulated) | rowwise-gw-hp "
                                  "(torchao); see docs/fp8-transformer-engine.md")
    fp8_format: str = opt("hybrid", "hybrid (e4m3 forward, e5m2 gradients) | e4m3 (everywhere)")
    fp8_amax_history_len: int = opt(1024, "delayed scaling: steps of amax history kept",
                                    range=positive_int)
    fp8_margin: int = opt(0, "delayed scaling: scales are divided by 2**margin",
                          range=non_negative_int)
    fp8_amax_compute_algo: str = opt("max", "delayed scaling: max (over the history) | "
                                            "most_recent")
    device: str = opt("auto", "auto | cpu | cuda")
    compile: bool = opt(False, "torch.compile each transformer block (one compiled graph "
                               "shared by every layer, so compiling costs the same at any "
                               "depth); the embedding and head stay eager")
    peak_tflops: str = opt("auto", "peak TFLOP/s per device that MFU is reported against: a "
                                   "number, auto (the datasheet peak of a known CUDA GPU; else "
                                   "MFU is n/a) or measure (a matmul timed at start-up)")


def resolved_min_lr(train: TrainConfig) -> float:
    """The learning rate the decay ends at: `min_lr`, or a tenth of `lr` when unset.

    The tenth is taken of `lr` as written in decimal (3e-3 gives exactly 3e-4, where
    `3e-3 * 0.1` would give 3.0000000000000003e-4), so a default schedule is the one written.
    Raises `ConfigError` when `min_lr` exceeds `lr`: the schedule would rise instead of decay.
    """
    check_lr_range(train)
    if train.min_lr is None:
        return float(Decimal(repr(train.lr)) / 10)
    return train.min_lr


def check_lr_range(train: TrainConfig) -> None:
    """`ConfigError` unless min_lr (when set) is at most lr."""
    if train.min_lr is not None and train.min_lr > train.lr:
        raise ConfigError(f"--min-lr {train.min_lr:g} is above --lr {train.lr:g}: the learning "
                          "rate decays from lr to min_lr; lower --min-lr or leave it out "
                          "(default: lr / 10)")


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
    skip_data_steps: list[str] = opt([], "never train on the batches of these steps, as "
                                         "A-B ranges of a run that skips nothing (e.g. 120-160); "
                                         "later steps take the batches after them",
                                     nargs="+")


@dataclass(frozen=True)
class LoopConfig:
    output: str = opt("runs/pretrain", "run directory: checkpoints, metrics.jsonl, tensorboard/")
    log_interval: int = opt(10, "print a metrics line every N steps", range=positive_int)
    eval_interval: int = opt(50, "validation loss/perplexity every N steps (0: only at the end)",
                             range=non_negative_int)
    eval_batches: int = opt(4, "validation batches per evaluation", range=non_negative_int)
    save_interval: int = opt(100, "checkpoint every N steps (0: only at the end)",
                             range=non_negative_int)
    keep_last: int = opt(2, "checkpoints to keep (older ones are deleted; 0: all)",
                         range=non_negative_int)
    async_save: bool = opt(False, "write checkpoints on a background thread while training "
                                  "goes on (the step waits only for a copy of the tensors to "
                                  "host memory, which then holds a second copy of the weights "
                                  "and optimizer state)")
    # A str, not a Literal: `parse` reads every spelling (true/yes/1, a YAML bool) into one.
    resume: str = opt("auto", "the run already in output/: auto (continue from its latest "
                              "checkpoint when that records this config; start when it has none; "
                              "refuse another config), true (continue it whatever its config), "
                              "false (refuse it)",
                      parse=resume_mode, const="true")
    overwrite: bool = opt(False, "delete the run already in output/ (checkpoints, metrics) and "
                                 "start over")
    progress: bool = opt(True, "show a progress bar")
    tensorboard: bool = opt(True, "write TensorBoard events when tensorboard is installed")
    # A step with a non-finite loss or gradient norm never updates the weights; these decide
    # what persisting trouble does. Judged where losses are read: at logging steps.
    bad_step_policy: str = opt("stop", "after --max-bad-steps consecutive steps with a "
                                       "non-finite loss or gradient norm (each skipped), or a "
                                       "loss spike: stop (with an error naming the step) | "
                                       "rollback (reload the last checkpoint and skip the "
                                       "batches trained on since) | skip (only log it)")
    max_bad_steps: int = opt(5, "consecutive skipped (non-finite) steps that trigger "
                                "--bad-step-policy", range=positive_int)
    loss_spike_factor: float = opt(0.0, "a loss over this many times the mean of the last "
                                        "--loss-spike-window steps' losses triggers "
                                        "--bad-step-policy (0: off)", range=non_negative_float)
    loss_spike_window: int = opt(20, "steps of loss history a spike is measured against "
                                     "(none is judged before it fills)", range=positive_int)
    # Here, not in `train`: it does not change what trains, so `--resume auto` may change it.
    collective_timeout_s: float = opt(
        600.0, "seconds a rank waits in one collective before the job stops, naming the ranks "
               "that did not answer (a restarting launcher then starts it again); must exceed "
               "the longest time one rank works alone: a checkpoint save, an evaluation, the "
               "first step's compilation", range=Bounded(float, low=1, high=86_400))


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
    # --- Expert parallelism: MoE models only, folded over tp x cp x dp.
    ep: int = 1
    etp: int = 1
    # dynamic context parallelism
    cp_dynamic: bool = False
    # MoE token dispatcher under expert parallelism
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


# The parallel section's fields carry no metadata: their flag ranges are listed here.
_PARALLEL_RANGES: dict[str, Bounded] = {
    **dict.fromkeys(("tp", "pp", "virtual_stages", "dp", "cp", "micro_batches", "ep", "etp"),
                    positive_int),
    "recompute_layers": non_negative_int,
}


def field_range(f: dataclasses.Field, ranges: dict[str, Bounded] | None = None) -> Bounded | None:
    """The range a field's flag and YAML value must lie in (`ranges` overrides, per verb)."""
    if ranges and f.name in ranges:
        return ranges[f.name]
    return f.metadata.get("range") or _PARALLEL_RANGES.get(f.name)


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
        "a sample generation) into runs/demo; run again, it keeps a finished demo run and prints "
        "its samples (--overwrite trains it anew; an interrupted one continues). "
        "Fields come from --config YAML, then flags; a flag can be bare (--lr) or dotted "
        "(--train.lr).",
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
    parser.add_argument("--nproc-per-node", type=non_negative_int, default=0, metavar="N",
                        help="start this many local ranks with torch's launcher (torchrun) "
                        "(default: 0, this process only)")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                        help="with --nproc-per-node: when a rank fails, restart all of them up "
                        "to N times; they continue from the latest checkpoint (--resume auto) "
                        "(default: 0)")
    parser.add_argument("--demo", action="store_true", help="run the built-in demo")
    add_section_flags(parser, SECTIONS, PretrainConfig())
    return parser


def add_section_flags(parser: argparse.ArgumentParser, sections: dict[str, type],
                      defaults: Any = None, ranges: dict[str, Bounded] | None = None) -> None:
    """One flag per field of each section's dataclass, bare (`--lr`) and dotted (`--train.lr`).

    Values land in `args` as `SECTION.FIELD` only when given (`section_values` merges them).
    `--help` lists the bare flag with the field's default, taken from `defaults` (an object with
    one attribute per section, e.g. `PretrainConfig()`) or else from the dataclass; the dotted
    and underscore spellings work but are not listed again. Numeric flags are range-checked
    (`field_range`; `ranges` overrides a field's range for this verb).
    """
    for section, owner in sections.items():
        group = parser.add_argument_group(section)
        values = getattr(defaults, section, None) or owner()
        for f in dataclasses.fields(owner):
            typ = _type_of(f, owner)
            if typing.get_origin(typ) in (typing.Union, types.UnionType):  # `float | None`
                typ = next(a for a in typing.get_args(typ) if a is not type(None))
            help_ = f.metadata.get("help") or _PARALLEL_HELP.get(f.name, "")
            metavar = {int: "N", float: "X"}.get(typ, f.name.upper())
            kw: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS,
                                  "metavar": metavar}
            if f.metadata.get("parse"):
                kw.update(type=f.metadata["parse"], nargs="?", const=f.metadata["const"],
                          metavar="MODE")
            elif typ is bool:
                kw.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
            elif f.metadata.get("nargs"):
                kw.update(nargs=f.metadata["nargs"])
            elif typ in (int, float):
                kw["type"] = field_range(f, ranges) or typ
            elif typ is str:
                kw["type"] = typ
            names = [f"--{f.name.replace('_', '-')}", f"--{section}.{f.name}"]
            if "_" in f.name:
                names.append(f"--{f.name}")
            group.add_argument(names[0], help=with_default(help_, getattr(values, f.name)), **kw)
            for alias in names[1:]:
                group.add_argument(alias, help=argparse.SUPPRESS, **kw)


def load_config(argv: list[str]) -> tuple[PretrainConfig, argparse.Namespace]:
    """Parse argv (YAML first, flags win) into a `PretrainConfig`; errors name the bad key."""
    args = build_parser().parse_args(argv)
    check_launcher_flags(args)
    raw = read_yaml(args.config)
    model_spec = raw.pop("model", None)
    sections = {section: owner(**values) for (section, values), owner in
                zip(section_values(raw, args, SECTIONS, args.config).items(), SECTIONS.values())}
    model, fields_set = model_from_spec(model_spec, args.model, args.model_overrides)
    config = PretrainConfig(model=model, model_fields_set=fields_set, **sections)
    check_lr_range(config.train)
    return config, args


def check_launcher_flags(args: argparse.Namespace) -> None:
    """`--max-restarts` restarts the ranks `--nproc-per-node` starts: alone it is an error."""
    if args.max_restarts and not args.nproc_per_node:
        raise ConfigError("--max-restarts restarts the ranks that --nproc-per-node starts: add "
                          "--nproc-per-node N (under torchrun, use torchrun's own --max-restarts)")


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
                   source: str | None, ranges: dict[str, Bounded] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Field values by section: YAML `raw` (grouped by section, or flat) first, then the flags
    in `args` (from `add_section_flags`). YAML values are coerced to their field's type; an
    unknown key is an error naming it (the caller pops its own non-section keys first), and so is
    a number out of its field's range (`field_range`)."""
    out: dict[str, dict[str, Any]] = {s: {} for s in sections}
    known = {f.name: s for s, owner in sections.items() for f in dataclasses.fields(owner)}
    hints = {s: typing.get_type_hints(owner) for s, owner in sections.items()}
    bounds = {f.name: field_range(f, ranges) for owner in sections.values()
              for f in dataclasses.fields(owner)}
    parsers = {f.name: f.metadata.get("parse") for owner in sections.values()
               for f in dataclasses.fields(owner)}

    def coerce(where: str, name: str, value: Any, hint: Any) -> Any:
        if parsers[name] is None:
            return coerce_field(where, value, hint, bounds[name])
        try:
            return parsers[name](value)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    for key, value in raw.items():
        if key in sections and isinstance(value, dict):
            for k, v in value.items():
                if k not in known or known[k] != key:
                    raise ConfigError(f"{source}: unknown field {key}.{k}")
                out[key][k] = coerce(f"{source}: {key}.{k}", k, v, hints[key][k])
        elif key in known:  # a flat field (`data` is both a section and a field)
            out[known[key]][key] = coerce(f"{source}: {key}", key, value, hints[known[key]][key])
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
