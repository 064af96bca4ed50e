"""The expert-parallel fields of `Layout`: validation messages that name the numbers
and the fix, the folded expert grid's coordinates, and old layouts reading as before."""

from __future__ import annotations

import pytest

from tessera.core import ConfigError, Layout, ModelConfig
from tessera.core.moe.config import MoEConfig
from tessera.core.parallel.expert_groups import edp_size, expert_mesh
from tessera.core.parallel.groups import layout_mesh, rank_of

MOE = ModelConfig.from_name("llama-tiny", moe=MoEConfig(num_experts=8, ffn_hidden_size=96))


def test_defaults_keep_old_layouts():
    assert Layout.from_dict({"tp": 2, "pp": 1, "virtual_stages": 1}) == Layout(tp=2)
    assert Layout().ep == 1 and Layout().etp == 1
    assert Layout(dp=4).problems(ModelConfig.from_name("llama-tiny")) == []


@pytest.mark.parametrize("layout, model, needles", [
    (Layout(dp=4, ep=3), MOE, ["num_experts 8 is not divisible by ep 3", "[1, 2, 4, 8]",
                               "ep 3 does not divide dp 4 x cp 1 = 4"]),
    (Layout(dp=2, ep=4), MOE, ["ep 4 does not divide dp 2 x cp 1 = 2", "use ep in [1, 2]"]),
    (Layout(dp=2, etp=5), MOE, ["expert FFN size 96 is not divisible by etp 5",
                                "ep 1 x etp 5 = 5 does not divide", "tp 1 x cp 1 x dp 2 = 2"]),
    (Layout(tp=2, dp=2, ep=2), MOE, ["tp 2 with ep 2 x etp 1 needs sequence_parallel"]),
    (Layout(dp=2, ep=2), ModelConfig.from_name("llama-tiny"),
     ["this model is dense (num_experts 0)"]),
    (Layout(dp=2, ep=0), MOE, ["ep must be >= 1, got 0"]),
])
def test_bad_expert_layouts_name_the_numbers(layout, model, needles):
    with pytest.raises(ConfigError) as err:
        layout.validate(model)
    for needle in needles:
        assert needle in str(err.value)


def test_top_k_above_the_experts_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match="moe_top_k 9 must be between 1 and num_experts 8"):
        ModelConfig(moe=MoEConfig(num_experts=8, top_k=9))


def test_good_expert_layouts_pass():
    for lay in (Layout(dp=2, ep=2), Layout(dp=4, ep=2, etp=2), Layout(dp=4, ep=4),
                Layout(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True),
                Layout(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True, pp=2)):
        lay.validate(MOE)


def _expert_coords(rank: int, lay: Layout) -> tuple[int, int, int, int]:
    at = expert_mesh(lay, layout_mesh(lay)).coords(rank)
    return at["etp"], at["ep"], at["edp"], at["pp"]


def test_expert_grid_folds_over_each_stage():
    lay = Layout(tp=2, cp=1, dp=4, pp=2, ep=2, etp=2, sequence_parallel=True)
    assert edp_size(lay) == 2
    mesh = expert_mesh(lay, layout_mesh(lay))
    seen = set()
    for rank in range(lay.world_size):
        etp_rank, ep_rank, edp_rank, pp_rank = _expert_coords(rank, lay)
        assert mesh.rank(etp=etp_rank, ep=ep_rank, edp=edp_rank, pp=pp_rank) == rank
        seen.add((etp_rank, ep_rank, edp_rank, pp_rank))
    assert len(seen) == lay.world_size
    # etp equal to tp: the etp group is the tp group, ep is carved out of dp.
    for t in range(2):
        for d in range(4):
            etp_rank, ep_rank, edp_rank, pp_rank = _expert_coords(rank_of(t, d, 1, lay), lay)
            assert (etp_rank, ep_rank, edp_rank, pp_rank) == (t, d % 2, d // 2, 1)
    # etp 1 < tp 2 folds ep over the tp peers (kept on one node, as Megatron folds it).
    folded = Layout(tp=2, dp=2, ep=2, sequence_parallel=True)
    assert [_expert_coords(r, folded)[1] for r in range(4)] == [0, 1, 0, 1]


def test_pretrain_and_tune_flags_and_yaml_reach_the_layout(tmp_path):
    # (Not training.loop.check_config: importing the loop costs seconds; it validates with
    # the same Layout.validate.)
    from tessera.training.config import load_config
    from tessera.tuning.config import build_parser as build_tune_parser

    cfg, _ = load_config(["--ep", "2", "--etp", "2", "--dp", "4", "--model", "llama-tiny",
                          "--model-overrides", "num_experts=4", "moe_ffn_hidden_size=32"])
    assert cfg.parallel.layout() == Layout(dp=4, ep=2, etp=2)
    cfg.parallel.layout().validate(cfg.model, world_size=4)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: llama-tiny\nparallel:\n  ep: 2\n  dp: 2\n")
    cfg, _ = load_config(["--config", str(yaml_file)])
    assert cfg.parallel.layout() == Layout(dp=2, ep=2)
    with pytest.raises(ConfigError, match="this model is dense"):
        cfg.parallel.layout().validate(cfg.model, world_size=2)
    assert "--ep N" in build_tune_parser().format_help()


def test_fsdp_refused_with_expert_parallelism_naming_zero1():
    from tessera.core import TrainSchedule
    from tessera.core.parallel.pipeline import train_schedule_problems

    lay = Layout(dp=4, ep=2)
    problems = train_schedule_problems(lay, TrainSchedule(data_parallel="fsdp"))
    assert any("data_parallel 'fsdp' shards every parameter" in p and "ep 2 x etp 1" in p
               and "use data_parallel 'zero1'" in p for p in problems), problems
    # zero1 shards expert pieces' optimizer state over edp (tests/distributed/test_moe_zero1.py)
    assert train_schedule_problems(lay, TrainSchedule(data_parallel="zero1")) == []
    assert train_schedule_problems(lay, TrainSchedule()) == []
    assert train_schedule_problems(Layout(dp=4), TrainSchedule(data_parallel="zero1")) == []
