"""What every pipeline stage of every model family keeps about its run and its place.

`GPTModel`, `BertModel` and `T5Model` are built one per pipeline stage; each calls
`init_stage` first, so the attributes the rest of the code reads from any stage (`config`,
`layout`, `train_schedule`, `groups`, `stage_id`, `num_stages`, `is_first`, `is_last`) are
set in one place and mean the same for every family. Which layers a stage holds differs by
family (`core.models.family.Family.stage_layers`) and stays with the model.
"""

from __future__ import annotations

from torch import nn

from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.parallel.groups import ParallelGroups


def init_stage(stage: nn.Module, config: ModelConfig, layout: Layout | None,
               groups: ParallelGroups | None, stage_id: int, num_stages: int,
               schedule: TrainSchedule | None) -> None:
    """Set `stage`'s run attributes; unset layout, groups and schedule mean one process with
    the defaults. The schedule is how a training step runs; a model reads only its
    recomputation."""
    stage.config, stage.layout = config, layout or Layout()
    stage.train_schedule = schedule or TrainSchedule()
    stage.groups = groups or ParallelGroups()
    stage.stage_id, stage.num_stages = stage_id, num_stages
    stage.is_first, stage.is_last = stage_id == 0, stage_id == num_stages - 1
