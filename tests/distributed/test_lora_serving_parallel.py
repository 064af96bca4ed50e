"""Per-request LoRA adapters on tensor-/pipeline-parallel gloo ranks: adapters given at start
are cut into every rank's pieces (B by rows on column-parallel layers, A by columns on
row-parallel ones) in the same slots, and a batch mixing two adapters and plain requests gives
the single-process engine's greedy tokens (which `tests/unit/serving/engine/test_lora_serving.py`
checks against the merged models). Adapters hot-loaded and unloaded while serving reach every
rank; a load that fails leaves every rank as it was."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.core.fingerprint import base_fingerprint
from tessera.core.lora_format import AdapterConfig, AdapterError, lora_names, save_adapter
from tessera.core.parallel.sharding import global_param_shapes
from tessera.serving.engine.adapters import AdapterBusy, LoRAServing, UnknownAdapter
from tessera.serving.engine.distributed import start_rank
from tests.distributed_helper import run_ranks
from tests.serving_helper import collect

# GQA (q, k, v parts of different sizes in the fused qkv) and SwiGLU's fused gate/up.
CONFIG = ModelConfig.from_name("llama-tiny", vocab_size=1003, init_std=0.1)


def _adapter(ckpt: str, out, seed: int, leaves: tuple[str, ...]) -> str:
    shapes, g = global_param_shapes(CONFIG), torch.Generator().manual_seed(seed)
    modules, tensors = [], {}
    for i in range(CONFIG.num_layers):
        for leaf in leaves:
            module = f"layers.{i}.{leaf}"
            out_f, in_f = shapes[f"{module}.weight"]
            a, b = lora_names(module)
            tensors[a] = torch.randn(6, in_f, generator=g) / in_f ** 0.5
            tensors[b] = torch.randn(out_f, 6, generator=g) * 0.3
            modules.append(module)
    config = AdapterConfig(rank=6, alpha=12.0, modules=tuple(modules),
                           base_fingerprint=base_fingerprint(ckpt))
    return str(save_adapter(out, config, tensors))


def _requests():
    from tessera.serving.types import GenerationRequest, SamplingParams

    prompts = [[1, 17, 42, 5, 9], list(range(5, 45)), [1, 17, 42, 5, 9], list(range(5, 45)),
               [1, *range(100, 130, 3)]]
    adapters = ["x", "y", None, None, "x"]
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True), adapter=a)
            for i, (p, a) in enumerate(zip(prompts, adapters))]


def _serve(ckpt: str, adapters: dict[str, str], tp: int, pp: int):
    lora = LoRAServing(max_loras=3, max_rank=8, checkpoint=ckpt,
                       preload=tuple(adapters.items()))
    # A short heartbeat: a hot-load waits for the idle engine's next one (1 s by default).
    engine = start_rank(ckpt, tp=tp, pp=pp, max_batch=5, tokenizer=None, lora=lora,
                        heartbeat_s=0.05)
    if engine is None:
        return None
    out = {"tokens": [r.token_ids for r in collect(engine, _requests())]}
    # Hot-loading (from this thread; the engine's loop runs on its own): "z" is x's directory
    # loaded again, then y's after a failed load, which must leave every rank as it was.
    first, plain = _requests()[0], _requests()[2]
    engine.load_adapter("z", adapters["x"])
    first.adapter = "z"
    out["z_as_x"] = collect(engine, [first])[0].token_ids
    with pytest.raises(AdapterBusy, match="already loaded"):
        engine.load_adapter("z", adapters["y"])
    engine.unload_adapter("z")
    with pytest.raises(UnknownAdapter):
        engine.unload_adapter("z")
    with pytest.raises(AdapterError, match="no adapter directory"):
        engine.load_adapter("z", adapters["x"] + "-missing")
    engine.load_adapter("z", adapters["y"])
    plain.adapter = "z"
    second = _requests()[1]
    second.adapter = "z"
    out["z_as_y"] = [r.token_ids for r in collect(engine, [second, plain])]
    engine.shutdown()
    return out


def _body(rank: int, world: int, ckpt: str, adapters: dict[str, str], layout: tuple[int, int]):
    return _serve(ckpt, adapters, *layout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    ckpt = str(save_checkpoint(root / "ckpt", build_model(CONFIG, seed=3)))
    adapters = {"x": _adapter(ckpt, root / "x", 1, ("attention.wqkv", "attention.wo",
                                                    "feed_forward.w1", "feed_forward.w2")),
                "y": _adapter(ckpt, root / "y", 2, ("attention.wo", "feed_forward.w1"))}
    reference = _serve(ckpt, adapters, 1, 1)
    _check(reference, reference["tokens"])  # hot-loading in one process
    return ckpt, adapters, reference["tokens"]


def _check(out, reference):
    assert out["tokens"] == reference
    assert out["z_as_x"] == reference[0]
    assert out["z_as_y"][0] == reference[1] and out["z_as_y"][1] != reference[2]


def test_tp2_adapters_given_at_start_match_one_process(setup):
    ckpt, adapters, reference = setup
    # The adapters change the answer (the same prompts, plain, in rows 2 and 3).
    assert reference[0] != reference[2] and reference[1] != reference[3]
    _check(run_ranks(_body, 2, ckpt, adapters, (2, 1), timeout=120)[0], reference)


@pytest.mark.slow
def test_tp2_pp2_adapters_given_at_start_match_one_process(setup):
    ckpt, adapters, reference = setup
    _check(run_ranks(_body, 4, ckpt, adapters, (2, 2), timeout=150)[0], reference)
