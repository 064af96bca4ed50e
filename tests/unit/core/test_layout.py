"""`Layout` (where weights live) apart from `TrainSchedule` (how a step runs): validation,
placement, the schedule checks against a layout, and the manifest that records the layout."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from tessera.converters.inspect import describe, render
from tessera.converters.reshard import reshard_checkpoint
from tessera.core import ConfigError, Layout, ModelConfig, TrainSchedule, build_model
from tessera.core.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    build_manifest,
    read_manifest,
    save_checkpoint,
)
from tessera.core.parallel.pipeline import (
    default_placement,
    split_layout_and_schedule,
    train_schedule_problems,
)
from tessera.core.parallel.sharding import (
    global_param_shapes,
    last_stage_pp_rank,
    stage_ids,
    stage_owners,
)

MODEL = ModelConfig.from_name("llama-tiny", num_layers=4)
CORE = Path(__file__).parents[3] / "core"


def test_core_config_imports_nothing_from_core_parallel():
    tree = ast.parse((CORE / "config.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m and "parallel" in m]


def test_layout_is_frozen_and_round_trips():
    layout = Layout(tp=2, pp=2, virtual_stages=2, placement="v", dp=3, sequence_parallel=True)
    assert Layout.from_dict(layout.to_dict()) == layout
    assert (layout.world_size, layout.num_stages) == (12, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4  # type: ignore[misc]
    # A version-1 manifest's layout: the missing fields take their defaults.
    assert Layout.from_dict({"tp": 2, "pp": 2, "virtual_stages": 1}) == Layout(tp=2, pp=2)
    with pytest.raises(ConfigError, match="unknown Layout fields"):
        Layout.from_dict({"tp": 2, "schedule": "1f1b"})


def test_layout_problems_name_the_fix():
    with pytest.raises(ConfigError, match="placement 'v' puts two stages on each pipeline rank"):
        Layout(pp=2, virtual_stages=1, placement="v").validate(MODEL)
    with pytest.raises(ConfigError, match="unknown placement 'w'"):
        Layout(placement="w").validate(MODEL)  # type: ignore[arg-type]
    Layout(tp=2, pp=2, virtual_stages=2, placement="v", dp=2).validate(MODEL, world_size=8)


def test_placement_decides_stages_not_the_schedule_name():
    looped, v = Layout(pp=2, virtual_stages=2), Layout(pp=2, virtual_stages=2, placement="v")
    assert [stage_ids(looped, p) for p in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(v, p) for p in range(2)] == [[0, 3], [1, 2]]
    assert (stage_owners(looped), stage_owners(v)) == ([0, 1, 0, 1], [0, 1, 1, 0])
    assert (last_stage_pp_rank(looped), last_stage_pp_rank(v)) == (1, 0)
    assert last_stage_pp_rank(Layout(pp=4)) == 3


def test_schedules_need_their_placement():
    assert [default_placement(s) for s in ("zbv", "dualpipev", "1f1b", "zero-bubble")] == [
        "v", "v", "looped", "looped"]
    layout, schedule = split_layout_and_schedule({"pp": 2, "virtual_stages": 2, "schedule": "zbv",
                                                  "micro_batches": 4, "recompute": "full"})
    assert layout == Layout(pp=2, virtual_stages=2, placement="v")
    assert schedule == TrainSchedule(schedule="zbv", micro_batches=4, recompute="full")
    assert train_schedule_problems(layout, schedule, global_batch=8) == []
    looped = dataclasses.replace(layout, placement="looped")
    assert any("set placement 'v'" in p for p in train_schedule_problems(looped, schedule))
    interleaved = dataclasses.replace(schedule, schedule="interleaved-1f1b")
    assert any("runs looped stage placement" in p
               for p in train_schedule_problems(layout, interleaved))
    with pytest.raises(ConfigError, match="unknown layout or schedule fields"):
        split_layout_and_schedule({"tp": 1, "pipeline": "zbv"})


def test_manifest_records_the_whole_layout(tmp_path):
    src = save_checkpoint(tmp_path / "one", build_model(MODEL, seed=3))
    raw = json.loads((src / "manifest.json").read_text())
    assert raw["format_version"] == FORMAT_VERSION == 2
    assert raw["layout"] == Layout().to_dict()
    reshard_checkpoint(src, tmp_path / "v", tp=2, pp=2, placement="v", progress=False)
    assert read_manifest(tmp_path / "v").layout == Layout(tp=2, pp=2, virtual_stages=2,
                                                            placement="v")
    assert "2 virtual stages per pipeline rank in a V" in render(describe(tmp_path / "v"))
    # Resharding the V checkpoint's tp keeps its placement; a new pp starts looped.
    reshard_checkpoint(tmp_path / "v", tmp_path / "v-tp1", tp=1, progress=False)
    assert read_manifest(tmp_path / "v-tp1").layout.placement == "v"
    reshard_checkpoint(tmp_path / "v", tmp_path / "pp4", pp=4, progress=False)
    assert read_manifest(tmp_path / "pp4").layout == Layout(tp=2, pp=4)


def test_build_manifest_checks_the_weight_map():
    names = list(global_param_shapes(MODEL))
    full = {n: ["model-tp00-pp00.safetensors"] for n in reversed(names)}
    manifest = build_manifest(MODEL, Layout(), full, dtype="float32", step=5)
    assert list(manifest.weight_map) == names  # stored in the model's parameter order
    with pytest.raises(CheckpointError, match="missing"):
        build_manifest(MODEL, Layout(), dict(list(full.items())[1:]), dtype="float32")
    with pytest.raises(ConfigError, match="num_heads 4 is not divisible by tp 3"):
        build_manifest(MODEL, Layout(tp=3), full, dtype="float32")
