"""Checkpoints of expert banks under any ep / etp, through the checkpoint writer:
the checks `test_expert_parallel` runs before, on and after 4 ranks.

The MoE layer lives on another branch, so a stand-in model chunk holds only expert banks
(`layers.{i}.feed_forward.experts.w1` / `.w2`, the contract's names and shapes), each rank its
piece (`shard_expert_tensor`), and they are the model's global parameters for the test. A
checkpoint saved by one process (ep 1) loads under ep2 x etp2 on 4 ranks; that one saves under
ep2 x etp2 and loads under ep4 and under tp2 (sequence parallel) x ep2 x etp1, which saves
again, and loads under tp2 without ep; every bank read back from every checkpoint, by one
process and by every rank, equals the original bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch
from torch import nn

from tessera.core import Layout, ModelConfig
from tessera.core.checkpoint import CheckpointReader, load_weights, save_checkpoint
from tessera.core.moe.config import MoEConfig
from tessera.core.parallel.groups import ParallelGroups, init_groups
from tessera.core.parallel.sharding import (
    expert_global_shape,
    shard_expert_tensor,
)

CONFIG = ModelConfig.from_name("llama-tiny", moe=MoEConfig(num_experts=4, ffn_hidden_size=12))
BANKS = [f"layers.{i}.feed_forward.experts.{w}" for i in range(CONFIG.num_layers)
         for w in ("w1", "w2")]


def _with_banks(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The stand-in's global parameters: only the expert banks (the dense ones are checked by
    the other checkpoint tests, and building a real model costs seconds per rank)."""
    return {n: expert_global_shape(n, config) for n in BANKS}


def full_banks() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: torch.randn(expert_global_shape(n, CONFIG), generator=gen) for n in BANKS}


class StandIn(nn.Module):
    """What the checkpoint code reads of a model chunk, holding this rank's bank pieces."""

    def __init__(self, layout: Layout, groups: ParallelGroups,
                 banks: dict[str, torch.Tensor] | None) -> None:
        super().__init__()
        self.config, self.layout, self.groups = CONFIG, layout, groups
        self.layers = nn.ModuleDict()
        for name in BANKS:
            _, i, _, _, which = name.split(".")
            if i not in self.layers:
                self.layers[i] = nn.Module()
                self.layers[i].feed_forward = nn.Module()
                self.layers[i].feed_forward.experts = nn.Module()
            full = banks[name] if banks else torch.zeros(expert_global_shape(name, CONFIG))
            piece = shard_expert_tensor(name, full, CONFIG, groups.ep_rank, groups.ep_size,
                                        groups.etp_rank, groups.etp_size)
            self.layers[i].feed_forward.experts.register_parameter(
                which, nn.Parameter(piece.clone()))

    def global_name(self, local_name: str) -> str:
        return local_name


def stand_in(layout: Layout, groups: ParallelGroups, banks: dict[str, torch.Tensor] | None
             ) -> StandIn:
    return StandIn(layout, groups, banks)


def _check_pieces(model, groups: ParallelGroups, banks, what: str) -> None:
    params = dict(model.named_parameters())
    for name in BANKS:
        want = shard_expert_tensor(name, banks[name], CONFIG, groups.ep_rank, groups.ep_size,
                                   groups.etp_rank, groups.etp_size)
        assert torch.equal(params[name], want), (what, name)


def check_checkpoints(rank: int, world: int, root: str) -> None:
    """On 4 ranks: load the one-process checkpoint, save and reload under other layouts."""
    root_path, banks = Path(root), full_banks()
    with mock.patch("tessera.core.checkpoint.global_param_shapes", _with_banks):
        a = Layout(dp=4, ep=2, etp=2)
        ga = init_groups(a)
        model = stand_in(a, ga, None)
        load_weights(model, root_path / "single")  # saved by one process, ep 1
        _check_pieces(model, ga, banks, "ep1 -> ep2 x etp2")
        save_checkpoint(root_path / "ep2xetp2", model)
        for lay in (Layout(dp=4, ep=4), Layout(tp=2, dp=2, ep=2, sequence_parallel=True)):
            groups = init_groups(lay)
            model = stand_in(lay, groups, None)
            load_weights(model, root_path / "ep2xetp2")
            _check_pieces(model, groups, banks, f"ep2 x etp2 -> {lay}")
        save_checkpoint(root_path / "tp2xep2", model)
        # Back to no expert parallelism at tp 2: two expert files, tp 2, but not tp shards.
        groups = init_groups(Layout(tp=2, dp=2))
        model = stand_in(Layout(tp=2, dp=2), groups, None)
        load_weights(model, root_path / "tp2xep2")
        _check_pieces(model, groups, banks, "tp2 x ep2 -> tp2")


def save_single(root: Path) -> None:
    """Before the ranks: the one-process (ep 1) checkpoint they load."""
    with mock.patch("tessera.core.checkpoint.global_param_shapes", _with_banks):
        save_checkpoint(root / "single", stand_in(Layout(), ParallelGroups(), full_banks()))


def check_saved(root: Path) -> None:
    """After the ranks: every checkpoint they wrote, read back by one process."""
    banks = full_banks()
    with mock.patch("tessera.core.checkpoint.global_param_shapes", _with_banks):
        files = sorted(p.name for p in (root / "ep2xetp2").glob("experts-*"))
        assert files == [f"experts-ep{e:02d}-etp{t:02d}-pp00.safetensors"
                         for e in range(2) for t in range(2)]
        for ckpt in ("single", "ep2xetp2", "tp2xep2"):
            reader = CheckpointReader(root / ckpt)
            for name in BANKS:
                assert torch.equal(reader.global_tensor(name), banks[name]), (ckpt, name)
            model = stand_in(Layout(), ParallelGroups(), None)
            load_weights(model, root / ckpt)
            _check_pieces(model, ParallelGroups(), banks, f"{ckpt} -> one process")
        manifest = CheckpointReader(root / "tp2xep2").manifest
        assert (manifest.layout.tp, manifest.layout.ep, manifest.layout.etp) == (2, 2, 1)
    # The resharder reads expert pieces of any ep / etp and writes whole banks (ep 1) into
    # each tp file; the model's file list comes from the stand-in's banks here.
    from tessera.converters.reshard import reshard_checkpoint

    def banks_in_every_file(config, layout):
        return {(t, 0): _with_banks(config) for t in range(layout.tp)}

    with mock.patch("tessera.core.checkpoint.global_param_shapes", _with_banks), \
            mock.patch("tessera.converters.reshard.global_param_shapes", _with_banks), \
            mock.patch("tessera.converters.reshard.target_files", banks_in_every_file):
        reshard_checkpoint(root / "ep2xetp2", root / "resharded", tp=2, progress=False)
        reader = CheckpointReader(root / "resharded")
        assert (reader.manifest.layout.tp, reader.manifest.layout.ep) == (2, 1)
        for name in BANKS:
            assert torch.equal(reader.global_tensor(name), banks[name]), ("resharded", name)
            assert torch.equal(reader.shard(name, 1, 2), banks[name]), ("resharded tp1", name)
