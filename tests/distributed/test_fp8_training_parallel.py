"""Emulated FP8 training under tensor parallelism, on gloo: three SGD steps of a tp2 model
(with and without sequence parallelism; delayed and current scaling) give the losses and the
FP8 scales of the single-process model.

Scales come from amaxes taken over the tp group (current scaling: in the product; delayed: at
the step's end), so each rank quantizes its shard exactly as one process quantizes the whole
tensor, and what differs is the summation order of the row-parallel all-reduce (seen: the
losses equal bit for bit, 0.0). Without the amax reductions each rank scales its shard by its
own amax, and the losses moved by 1.4e-5 to 7e-5 relative within three steps: the bound, 1e-6,
tells the two apart. Fused kernels are off on both sides (no compilation in spawned ranks).
"""

from __future__ import annotations

import pytest
import torch

from tessera.core import Layout, ModelConfig, build_model, fused
from tessera.core.fp8_recipe import Fp8Recipe
from tessera.core.fp8_training import enable_fp8_training
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import sync_sequence_parallel_grads
from tests.distributed_helper import run_ranks

SEED, STEPS, LR = 5, 3, 0.5
RECIPES = ["delayed", "tensorwise"]


def _config() -> ModelConfig:
    # heads 4 / kv 2, ffn 128: every local shard at tp2 is a multiple of 16, so all 8 are FP8
    return ModelConfig.from_name("llama-tiny", vocab_size=256, ffn_hidden_size=128)


def _train(recipe: str, parallel: Layout | None = None, groups=None) -> dict:
    fused.set_mode("off")
    try:
        return _steps(recipe, parallel, groups)
    finally:
        fused.set_mode(None)


def _steps(recipe: str, parallel: Layout | None, groups) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (STEPS, 4, 32))
    model = build_model(_config(), parallel, groups, seed=SEED)
    fp8 = enable_fp8_training([model], Fp8Recipe("emulated", recipe, amax_history_len=4),
                              groups)
    assert len(fp8.layers) == 8 and not fp8.fallback
    losses = []
    for step in range(STEPS):
        loss = model(ids[step], ids[step].roll(-1, dims=1))
        loss.backward()
        if parallel is not None and parallel.sequence_parallel:
            sync_sequence_parallel_grads([model], groups)
        fp8.step_end()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    scales = {name: layer.fp8_scale.clone() for name, layer in fp8.layers.items()}
    return {"losses": losses, "scales": scales}


def _body(rank: int, world_size: int) -> dict:
    out = {}
    for sp in (False, True):
        parallel = Layout(tp=world_size, sequence_parallel=sp)
        groups = init_groups(parallel)
        for recipe in RECIPES:
            out[(sp, recipe)] = _train(recipe, parallel, groups)
    return out


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(_body, 2, timeout=300, env={"TESSERA_FUSED_KERNELS": "off"})


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_fp8_training_matches_one_process(tp2, recipe):
    single = _train(recipe)
    assert len(set(single["losses"])) == STEPS  # it trains
    for sp in (False, True):
        for rank_out in tp2:
            got = rank_out[(sp, recipe)]
            err = max(abs(a - b) / b for a, b in zip(got["losses"], single["losses"]))
            print(f"\n{recipe} sp={sp}: max loss relative difference {err:.1e}")
            assert err < 1e-6, (got["losses"], single["losses"])
            if recipe == "delayed":
                for name, scale in single["scales"].items():
                    torch.testing.assert_close(got["scales"][name], scale, rtol=1e-6, atol=0)
