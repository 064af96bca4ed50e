"""Sharding rules of the expert banks: ep along dim 0, etp within each expert (w1's
gate and up halves each on their own, w2 along dim 2), and `unshard_tensors` putting any
ep x etp grid back bit-exactly. Checked against slicing written out by hand."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig
from tessera.core.moe.config import MoEConfig
from tessera.core.parallel.sharding import (
    expert_global_shape,
    expert_local_shape,
    is_expert_param,
    shard_expert_tensor,
    shard_spec,
    unshard_tensors,
)

GATED = ModelConfig.from_name("llama-tiny", moe=MoEConfig(num_experts=4, ffn_hidden_size=12))
PLAIN = ModelConfig.from_name("gpt2-tiny", moe=MoEConfig(num_experts=4, ffn_hidden_size=12))


def test_expert_names_and_shapes():
    assert is_expert_param("layers.3.feed_forward.experts.w1")
    assert is_expert_param("layers.0.feed_forward.experts.w2")
    for other in ("layers.0.feed_forward.w1.weight", "layers.0.feed_forward.router.weight",
                  "layers.0.feed_forward.shared_expert.w1.weight"):
        assert not is_expert_param(other)
    assert expert_global_shape("layers.0.feed_forward.experts.w1", GATED) == (4, 24, 64)
    assert expert_global_shape("layers.0.feed_forward.experts.w2", GATED) == (4, 64, 12)
    assert expert_global_shape("layers.0.feed_forward.experts.w1", PLAIN) == (4, 12, 64)
    # Never split over the attention's tp group: tp-based paths store them once.
    assert shard_spec("layers.0.feed_forward.experts.w1", GATED).dim is None


@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 3), (2, 6)])
@pytest.mark.parametrize("config", [GATED, PLAIN], ids=["gated", "plain"])
def test_shard_and_unshard_experts(config, ep, etp):
    f = 12
    for which in ("w1", "w2"):
        name = f"layers.1.feed_forward.experts.{which}"
        full = torch.randn(expert_global_shape(name, config))
        pieces = []
        for e in range(ep):
            for t in range(etp):
                piece = shard_expert_tensor(name, full, config, e, ep, t, etp)
                assert tuple(piece.shape) == expert_local_shape(name, config, ep, etp)
                block = full[e * 4 // ep:(e + 1) * 4 // ep]
                cols = slice(t * f // etp, (t + 1) * f // etp)
                if which == "w2":
                    want = block[:, :, cols]
                elif config.gated:  # its slice of gate, then its slice of up
                    want = torch.cat([block[:, :f][:, cols], block[:, f:][:, cols]], dim=1)
                else:
                    want = block[:, cols]
                assert torch.equal(piece, want), (name, e, t)
                pieces.append(piece)
        assert torch.equal(unshard_tensors(name, pieces, config), full)
        # Whole copies (replicated over tp) give the whole tensor.
        assert torch.equal(unshard_tensors(name, [full, full.clone()], config), full)


def test_init_gives_each_expert_grid_rank_its_piece_of_the_global_init():
    """`init_weights` under ep x etp equals the one-process initialization, sliced."""
    from unittest import mock

    from torch import nn

    from tessera.core.init import init_global_tensor, init_weights
    from tessera.core.parallel.groups import ParallelGroups

    banks = {f"layers.0.feed_forward.experts.{w}": expert_global_shape(
        f"layers.0.feed_forward.experts.{w}", GATED) for w in ("w1", "w2")}

    class Banks(nn.Module):  # a model chunk holding only this rank's expert pieces
        def __init__(self, groups: ParallelGroups) -> None:
            super().__init__()
            self.config, self.groups = GATED, groups
            self.layers = nn.ModuleDict({"0": nn.Module()})
            self.layers["0"].feed_forward = nn.Module()
            experts = self.layers["0"].feed_forward.experts = nn.Module()
            for name in banks:
                shape = expert_local_shape(name, GATED, groups.ep_size, groups.etp_size)
                experts.register_parameter(name[-2:], nn.Parameter(torch.empty(shape)))

        def global_name(self, local_name: str) -> str:
            return local_name

    with mock.patch("tessera.core.models.decoder.init.global_param_shapes", lambda config: banks):
        for ep_rank, etp_rank in ((0, 0), (1, 1), (0, 2)):
            g = ParallelGroups(ep_rank=ep_rank, ep_size=2, etp_rank=etp_rank, etp_size=3)
            model = Banks(g)
            init_weights(model, seed=5)
            for name, param in model.named_parameters():
                want = shard_expert_tensor(name, init_global_tensor(name, GATED, 5), GATED,
                                           ep_rank, 2, etp_rank, 3)
                assert torch.equal(param, want), (name, ep_rank, etp_rank)
