"""The run plan: a run's written config (YAML + flags) resolved once, at set-up, into frozen
sections, each handed to the one component that needs it.

    model      core.config.ModelConfig     the model builders
    layout     core.config.Layout          process groups, stage building, checkpoints
    schedule   core.config.TrainSchedule   pipeline schedule, micro-batches, recomputation,
                                           data-parallel flavour, cp communication
    precision  Precision                   weight and compute dtypes, loss scaling, FP8 recipe
    optimizer  OptimizerSettings           AdamW, the learning-rate schedule, clipping
    data       DataPlan                    datasets, sequence length, the batch split over ranks
    run        RunSettings                 seed, steps, device, compile, the MFU peak
    loop       LoopConfig                  output directory, intervals, checkpoints, logging

Derived values (dp from the world size, the per-rank and micro-batch sizes, dataset sizes) are
computed here and nowhere else, and every check of the config against the world runs here
(`resolve_plan` raises one `ConfigError` listing them). `RunPlan.record` is the config as
checkpoints save it: the written sections with the resolved values filled in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.fp8_recipe import Fp8Recipe, resolve_fp8_recipe
from tessera.core.parallel import pipeline
from tessera.training.config import LoopConfig, resolved_min_lr

PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16", "fp8")


@dataclass(frozen=True)
class Precision:
    """What the weights are kept in and what forwards compute in (`--precision` and its FP8
    settings, as `training.config.TrainConfig` documents them)."""

    name: str = "fp32"
    fp8_backend: str = "auto"
    fp8_recipe: str = "auto"
    fp8_format: str = "hybrid"
    fp8_amax_history_len: int = 1024
    fp8_margin: int = 0
    fp8_amax_compute_algo: str = "max"

    @property
    def weight_dtype(self) -> torch.dtype:
        """The model's parameter dtype (bf16-pure: bf16; else fp32 master weights)."""
        return torch.bfloat16 if self.name == "bf16-pure" else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """What forwards autocast to (None: none). fp8 runs everything outside the FP8 block
        linears in bf16."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(self.name)

    @property
    def matmul_dtype(self) -> torch.dtype | None:
        """The dtype matmuls run in, for the MFU peak (None: fp32)."""
        return self.autocast_dtype or (torch.bfloat16 if self.name == "bf16-pure" else None)

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales the loss dynamically (`torch.amp.GradScaler`)."""
        return self.name == "fp16"

    def fp8_recipe_on(self, device: torch.device) -> Fp8Recipe | None:
        """The FP8 recipe of a `--precision fp8` run on `device` (None for other precisions);
        a `ConfigError` says what to install or change when none can run."""
        if self.name != "fp8":
            return None
        return resolve_fp8_recipe(device, self.fp8_backend, self.fp8_recipe,
                                  fp8_format=self.fp8_format,
                                  amax_history_len=self.fp8_amax_history_len,
                                  margin=self.fp8_margin,
                                  amax_compute_algo=self.fp8_amax_compute_algo)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, its learning-rate schedule over `steps` and gradient clipping
    (`training.optim`); `sharded`: each dp rank keeps the state of its rows (zero1, fsdp)."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay: str
    weight_decay: float
    beta1: float
    beta2: float
    adam_eps: float
    clip_grad: float
    steps: int
    sharded: bool = False


@dataclass(frozen=True)
class DataPlan:
    """What the data loaders read and how one global batch splits over the ranks."""

    data: tuple[str, ...]  # indexed datasets, `--data` as written (weights and prefixes)
    tokenizer: str
    split: str
    data_cache: str
    isolate_documents: bool
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all data-parallel ranks
    per_dp_batch: int  # global_batch / dp: the rows of one data-parallel rank per step
    micro_batch_size: int  # global_batch / (dp x micro_batches)
    train_samples: int  # steps x global_batch
    valid_samples: int  # eval_batches x global_batch
    seed: int


@dataclass(frozen=True)
class RunSettings:
    """The run as a whole: seeding, length, device, compilation, the MFU reference."""

    seed: int
    steps: int
    device: str
    compile: bool
    peak_tflops: str


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved (see the module docstring); built by `resolve_plan`."""

    model: ModelConfig
    layout: Layout
    schedule: TrainSchedule
    precision: Precision
    optimizer: OptimizerSettings
    data: DataPlan
    run: RunSettings
    loop: LoopConfig
    # The config as checkpoints record it: the written sections with the resolved dp,
    # micro-batches, sequence length, batch and vocabulary filled in.
    record: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def with_model(self, model: ModelConfig) -> RunPlan:
        """This plan for `model`, its record to match. Not checked: meant for
        `resolve_plan`'s `prepare` step, whose result is."""
        record = {**self.record, "model": dataclasses.asdict(model)}
        return dataclasses.replace(self, model=model, record=record)


def resolve_micro_batches(parallel: Any, *, fill_pipeline: bool, weights_only: bool) -> int:
    """The micro-batches per step: as written, or 2 per pipeline stage (`fill_pipeline`, when
    the user wrote none: the demo), or at least one per stage (`weights_only`: the model is
    only built, its layout checked as a training one)."""
    stages = parallel.pp * parallel.virtual_stages
    if weights_only:
        return max(parallel.micro_batches, stages)
    if fill_pipeline and parallel.pp > 1:
        return 2 * stages
    return parallel.micro_batches


def resolve_plan(cfg: Any, world: int, *, model: ModelConfig | None = None,
                 seq_len: int | None = None, fill_pipeline: bool = False,
                 weights_only: bool = False,
                 prepare: Callable[[RunPlan], RunPlan] | None = None) -> RunPlan:
    """Resolve a written config for a world of `world` ranks, or raise one `ConfigError`
    listing everything that cannot run (layout, schedule, sequence length, precision).

    `cfg` is a `training.config.PretrainConfig` or `tuning.config.TuneRunConfig` (sections
    `train`, `parallel`, `loop`, a `model`, and `data` for pretraining); it is not changed.
    `model` replaces `cfg.model` and `seq_len` the written sequence length (tuning: what its
    examples need). dp left at 1 takes what tp x cp x pp leave of the world.
    `fill_pipeline` and `weights_only` decide the micro-batches (`resolve_micro_batches`);
    `weights_only` also picks a batch and sequence length that any layout accepts, since no
    step runs. `prepare` runs on the assembled plan before it is checked, and its result is
    the one checked and returned (pretraining: the family's and the data's own refusals come
    first, and the vocabulary follows the data).
    """
    par, train = cfg.parallel, cfg.train
    model = model if model is not None else cfg.model
    fixed = par.tp * par.cp * par.pp
    dp = world // fixed if par.dp == 1 and world > fixed and world % fixed == 0 else par.dp
    micro = resolve_micro_batches(par, fill_pipeline=fill_pipeline, weights_only=weights_only)
    parallel = dataclasses.replace(par, dp=dp, micro_batches=micro)
    global_batch = micro * world if weights_only else train.global_batch
    if weights_only:
        seq_len = math.lcm(8, par.tp)
    train = dataclasses.replace(train, global_batch=global_batch,
                                seq_len=train.seq_len if seq_len is None else seq_len)
    layout, schedule = parallel.layout(), parallel.train_schedule()
    resolved = dataclasses.replace(cfg, parallel=parallel, train=train, model=model)
    plan = RunPlan(model, layout, schedule, _precision(train),
                   optimizer_settings(train, schedule), _data(getattr(cfg, "data", None), train, layout,
                                                      schedule, cfg.loop),
                   RunSettings(train.seed, train.steps, train.device, train.compile,
                               train.peak_tflops),
                   cfg.loop, resolved.to_dict())
    if prepare is not None:
        plan = prepare(plan)
    _validate(plan.model, layout, schedule, train.global_batch, train.seq_len, train.precision,
              world)
    return plan


def _validate(model: ModelConfig, layout: Layout, schedule: TrainSchedule, global_batch: int,
              seq_len: int, precision: str, world: int) -> None:
    """Raise `ConfigError` for the layout and schedule on `world` ranks
    (`pipeline.validate_training`), then for the sequence length and precision."""
    pipeline.validate_training(model, layout, schedule, world_size=world,
                               global_batch=global_batch, seq_len=seq_len)
    problems: list[str] = []
    if seq_len > model.max_position_embeddings:
        problems.append(f"seq_len {seq_len} exceeds the model's "
                        f"max_position_embeddings {model.max_position_embeddings}")
    if precision not in PRECISIONS:
        problems.append(f"unknown precision {precision!r}; use fp32, bf16, bf16-pure, "
                        "fp16 or fp8")
    if (schedule.data_parallel != "ddp" and layout.dp * layout.cp > 1
            and precision == "fp16"):
        problems.append(f"data_parallel {schedule.data_parallel!r} does not support fp16's "
                        "gradient scaler; use --precision bf16 (or --data-parallel ddp)")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _precision(train: Any) -> Precision:
    return Precision(train.precision, train.fp8_backend, train.fp8_recipe, train.fp8_format,
                     train.fp8_amax_history_len, train.fp8_margin, train.fp8_amax_compute_algo)


def optimizer_settings(train: Any, schedule: TrainSchedule) -> OptimizerSettings:
    """The optimizer section of a written `train` section; `min_lr` resolved (a tenth of `lr`
    unless written, never above it: `config.resolved_min_lr`)."""
    return OptimizerSettings(train.lr, resolved_min_lr(train), train.warmup_steps, train.decay,
                             train.weight_decay, train.beta1, train.beta2, train.adam_eps,
                             train.clip_grad, train.steps,
                             sharded=schedule.data_parallel in ("zero1", "fsdp"))


def _data(data: Any, train: Any, layout: Layout, schedule: TrainSchedule,
          loop: LoopConfig) -> DataPlan:
    # Sizes below 1 are refused by the checks that follow; until then they split nothing.
    per_dp = train.global_batch // layout.dp if layout.dp >= 1 else 0
    return DataPlan(
        data=tuple(data.data) if data else (), tokenizer=data.tokenizer if data else "",
        split=data.split if data else "", data_cache=data.data_cache if data else "",
        isolate_documents=bool(data and data.isolate_documents), seq_len=train.seq_len,
        global_batch=train.global_batch, per_dp_batch=per_dp,
        micro_batch_size=per_dp // schedule.micro_batches if schedule.micro_batches >= 1 else 0,
        train_samples=train.steps * train.global_batch,
        valid_samples=loop.eval_batches * train.global_batch, seed=train.seed)
