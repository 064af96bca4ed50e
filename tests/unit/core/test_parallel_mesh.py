"""The named rank mesh (`core.parallel.mesh`) and the process groups built from it.

`tests/fixtures/parallel_groups.json` was recorded from the hand-written loop nests that built
the groups before the mesh (`init_groups`, `build_expert_groups`, `DynamicCP.create` at commit
f62e6df), run for every rank under the stand-in `torch.distributed` below: per layout, every
rank's `ParallelGroups` fields (a group as its rank list) and dynamic-cp blocks, and the rank
lists of all groups created. Rank order decides which ranks hold which shards (checkpoints,
placement, the distributed parity tests), so the mesh must reproduce it exactly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from tessera.core import Layout, ModelConfig
from tessera.core.parallel.dynamic_cp_runtime import DynamicCP
from tessera.core.parallel.expert_groups import expert_mesh
from tessera.core.parallel.groups import init_groups, layout_mesh, rank_of
from tessera.core.parallel.mesh import RankMesh

TABLE = json.loads((Path(__file__).parents[2] / "fixtures" / "parallel_groups.json").read_text())


@dataclasses.dataclass(frozen=True)
class FakeGroup:
    ranks: tuple[int, ...]


def _plain(value):
    if isinstance(value, FakeGroup):
        return list(value.ranks)
    return list(value) if isinstance(value, tuple) else value


def _record(layout: Layout, kv_replicas: int, dynamic_cp: bool):
    """Per rank: its fields as in the table, and the rank lists it passed to new_group."""
    fields_by_rank, calls_by_rank = [], []
    for rank in range(layout.world_size):
        calls: list[list[int]] = []

        def new_group(ranks, calls=calls, **_):
            calls.append(list(ranks))
            return FakeGroup(tuple(ranks))

        with mock.patch.multiple(dist, is_available=lambda: True, is_initialized=lambda: True,
                                 get_world_size=lambda: layout.world_size,
                                 get_rank=lambda rank=rank: rank, new_group=new_group):
            g = init_groups(layout, kv_replicas)
            fields = {f.name: _plain(getattr(g, f.name)) for f in dataclasses.fields(g)}
            if dynamic_cp:
                blocks = DynamicCP.create(ModelConfig.from_name("llama-tiny"), layout, g).blocks
                fields["dynamic_cp_blocks"] = {f"{k},{first}": _plain(group)
                                               for (k, first), group in sorted(blocks.items())}
        fields_by_rank.append(fields)
        calls_by_rank.append(calls)
    return fields_by_rank, calls_by_rank


@pytest.mark.parametrize("case", TABLE, ids=[c["case"] for c in TABLE])
def test_groups_equal_the_recorded_loop_nests(case):
    layout = Layout.from_dict(case["layout"])
    fields, calls = _record(layout, case["kv_replicas"], case["dynamic_cp"])
    for rank, (got, want) in enumerate(zip(fields, case["ranks"])):
        assert got == want, f"rank {rank}"
    # new_group is collective: every rank creates the same groups in the same order, and
    # exactly the groups the loop nests created (none of size 1).
    assert all(c == calls[0] for c in calls)
    assert sorted(calls[0]) == case["created"]


def test_layout_table_covers_every_named_and_flattened_dimension():
    layouts = [Layout.from_dict(c["layout"]) for c in TABLE]
    assert any(lay.tp > 1 and lay.pp > 1 and lay.dp > 1 for lay in layouts)
    assert any(lay.dp > 1 and lay.cp > 1 and lay.tp > 1 and lay.pp > 1 for lay in layouts)
    assert any(lay.virtual_stages > 1 for lay in layouts)
    assert any(c["kv_replicas"] > 1 and Layout.from_dict(c["layout"]).pp > 1 for c in TABLE)
    assert any(lay.ep > 1 and lay.etp == 1 and lay.tp > 1 for lay in layouts)
    assert any(lay.ep > 1 and lay.etp > 1 and lay.cp > 1 for lay in layouts)
    assert any(c["dynamic_cp"] and Layout.from_dict(c["layout"]).cp >= 8 for c in TABLE)


def test_sub_meshes_list_ranks_with_the_first_named_dimension_slowest():
    mesh = RankMesh.of(pp=2, dp=2, cp=2, tp=2)
    assert mesh.shape == {"pp": 2, "dp": 2, "cp": 2, "tp": 2}
    assert mesh.groups("tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert mesh.groups("pp")[:2] == [[0, 8], [1, 9]]
    assert mesh.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                       [9, 11, 13, 15]]
    assert mesh.groups("cp", "dp")[0] == [0, 4, 2, 6]
    assert mesh.group_of(13, "dp", "cp") == [9, 11, 13, 15]
    assert mesh.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    assert all(mesh.rank(**mesh.coords(r)) == r for r in range(16))


def test_regroup_refactors_the_same_ranks():
    dense = RankMesh.of(pp=2, dp=2, cp=1, tp=2)
    expert = dense.regroup(["dp", "cp", "tp"], edp=1, ep=2, etp=2)
    assert expert.shape == {"pp": 2, "edp": 1, "ep": 2, "etp": 2}
    assert expert.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert.groups("etp") == dense.groups("tp")
    kv = dense.regroup(["tp"], kv_block=1, kv=2)
    assert kv.groups("kv") == dense.groups("tp")


def test_rank_of_is_the_layout_formula():
    lay = Layout(tp=2, cp=3, dp=2, pp=2)
    for pp in range(2):
        for dp in range(2):
            for cp in range(3):
                for tp in range(2):
                    assert rank_of(tp, dp, pp, lay, cp) == ((pp * 2 + dp) * 3 + cp) * 2 + tp


def test_expert_mesh_folds_each_stage():
    lay = Layout(tp=2, dp=4, pp=2, ep=2, etp=2, sequence_parallel=True)
    mesh = expert_mesh(lay, layout_mesh(lay))
    assert mesh.shape == {"pp": 2, "edp": 2, "ep": 2, "etp": 2}
    assert mesh.coords(rank_of(1, 3, 1, lay)) == {"pp": 1, "edp": 1, "ep": 1, "etp": 1}


@pytest.mark.parametrize("call, message", [
    (lambda m: m.groups("ep"), r"mesh dimensions \('ep',\): each must be one of"),
    (lambda m: m.groups("tp", "tp"), "named once"),
    (lambda m: m.regroup(["pp", "tp"], a=4), "needs adjacent dimensions"),
    (lambda m: m.regroup(["dp", "pp"], a=4), "needs adjacent dimensions in mesh order"),
    (lambda m: m.regroup(["tp"], a=3), r"new sizes multiply to 3, not 2"),
    (lambda m: m.regroup(["tp"], dp=2), "must be distinct"),
    (lambda m: m.rank(pp=0, dp=0), r"needs a coordinate for each of \('pp', 'dp', 'tp'\)"),
    (lambda m: m.rank(pp=0, dp=2, tp=0), r"dp coordinate 2 is outside 0..1"),
    (lambda m: m.coords(8), "rank 8 is not in this mesh of 8 ranks"),
])
def test_bad_mesh_requests_say_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call(RankMesh.of(pp=2, dp=2, tp=2))


def test_bad_mesh_sizes_are_refused():
    with pytest.raises(ValueError, match=r"sizes must be >= 1, got \{'dp': 0\}"):
        RankMesh.of(pp=2, dp=0)


def test_kv_replicas_that_do_not_divide_tp_are_refused_before_any_group():
    created = []
    with mock.patch.multiple(dist, is_available=lambda: True, is_initialized=lambda: True,
                             get_world_size=lambda: 4, get_rank=lambda: 0,
                             new_group=lambda ranks, **_: created.append(ranks)):
        with pytest.raises(ValueError, match="kv_replicas 3 does not divide tp 4"):
            init_groups(Layout(tp=4), kv_replicas=3)
    assert created == []
