"""kv heads replicated over tp ranks (tp > num_kv_heads), on 4 and 8 gloo ranks: tp4 with 2 kv
heads, tp8 with 4 (and tp4 x pp2, tp4 x dp2, sequence parallel).

- gloo equivalence: one step's loss (1e-5 relative) and every gathered gradient (1e-4, after
  `sync_kv_replica_grads`) equal the single-process model's, and the replicas of each kv head
  hold the same gradient;
- HF parity via convert: a random-weight `LlamaForCausalLM` built here, imported with `tessera
  convert --from hf` and resharded with `tessera convert --tp`, gives HF's logits under that tp;
- `save_checkpoint` under tp stores each kv head once (the stored bytes) and the checkpoint
  loads in one process with the weights of the single-process model;
- greedy generation with the KV cache (one kv head per rank) equals the single-process one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tessera.converters.cli import main as convert_main
from tessera.core.checkpoint import (
    CheckpointReader,
    load_checkpoint,
    load_weights,
    read_manifest,
    save_checkpoint,
)
from tessera.core.config import Layout, ModelConfig
from tessera.core.generation import generate_ids
from tessera.core.init import build_model
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.sharding import global_param_shapes, kv_replicas, replica_rows
from tests.distributed._parity import Case, check_case, run_cases
from tests.distributed_helper import run_ranks

# One spawn of 4 and one of 8 ranks run every case (fixture setup counts against the first
# test's time): on a busy 2-core machine the 8-rank spawn alone takes minutes.
pytestmark = pytest.mark.timeout(1500)

KV2 = {"num_heads": 8, "num_kv_heads": 2}
KV4 = {"num_heads": 8, "num_kv_heads": 4}
CASES = {
    4: [
        Case("llama-kv2-tp4", "llama-tiny", {"tp": 4}, model=KV2),
        Case("llama-kv2-tp4-sp", "llama-tiny", {"tp": 4, "sequence_parallel": True},
             model={**KV2, "vocab_size": 1003}),
        Case("nemotron-kv1-tp4", "nemotron-tiny", {"tp": 4}, model={"num_kv_heads": 1}),
    ],
    8: [
        Case("llama-kv4-tp8", "llama-tiny", {"tp": 8}, model={**KV4, "bias": True}),
        Case("llama-kv2-tp4-pp2", "llama-tiny", {"tp": 4, "pp": 2, "micro_batches": 2},
             model=KV2),
        Case("llama-kv2-tp4-dp2", "llama-tiny", {"tp": 4, "dp": 2}, model=KV2),
    ],
}
# HF Llama per world size: 8 query heads over 2 (tp 4) or 4 (tp 8) kv heads.
HF_KV = {4: 2, 8: 4}
IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
PROMPT = [5, 17, 42, 7]
SAVED = ModelConfig.from_name("llama-tiny", num_heads=8, hidden_size=64, ffn_hidden_size=128,
                              vocab_size=1003)


def _saved_config(world: int) -> ModelConfig:
    return ModelConfig.from_dict({**SAVED.to_dict(), "num_kv_heads": HF_KV[world]})


def _rank_body(rank: int, world: int, cases: list[Case], hf_ckpt: str, save_dir: str) -> dict:
    parity = run_cases(rank, world, cases)
    par = Layout(tp=world)
    config = read_manifest(hf_ckpt).model
    groups = init_groups(par, kv_replicas=kv_replicas(config, world))
    model = build_model(config, par, groups, init=False)
    load_weights(model, hf_ckpt)
    model.eval()
    with torch.no_grad():
        logits = model(IDS)
    tokens = generate_ids(model, PROMPT, 8)
    saved = _saved_config(world)
    save_checkpoint(save_dir, build_model(saved, par, groups, seed=21))
    return {"parity": parity, "logits": logits, "tokens": tokens}


@torch.no_grad()
def _hf_llama(num_kv_heads: int):
    # Imported here, not at module level: the spawned ranks import this module too.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=num_kv_heads,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    for p in model.parameters():  # every weight and norm perturbed: a swap shows in the logits
        p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


def _run_world(world: int, root: Path) -> dict:
    """Everything on `world` ranks, in one spawn; returns what the tests check."""
    hf = _hf_llama(HF_KV[world])
    hf.save_pretrained(root / "hf")
    assert convert_main(["--from", "hf", "--input", str(root / "hf"),
                         "--output", str(root / "tp1")]) == 0
    assert convert_main(["--input", str(root / "tp1"), "--output", str(root / "tp"),
                         "--tp", str(world)]) == 0
    results = run_ranks(_rank_body, world, CASES[world], str(root / "tp"), str(root / "saved"),
                        timeout=900)
    return {"world": world, "hf": hf, "root": root, "results": results}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _run_world(4, tmp_path_factory.mktemp("kv-tp4"))


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return _run_world(8, tmp_path_factory.mktemp("kv-tp8"))


@pytest.fixture(params=[4, 8], ids=lambda w: f"tp{w}")
def world(request):
    return request.getfixturevalue(f"world{request.param}")


def _check_step(case: Case, world: dict) -> None:
    results = [r["parity"][CASES[world["world"]].index(case)] for r in world["results"]]
    diffs = check_case(case, results)
    assert diffs["loss_rel"] <= 1e-5 and diffs["grads"] <= 1e-4
    # The replicas of each kv head took the same (summed) gradient.
    config, tp = case.model_config(), case.parallel["tp"]
    rep = kv_replicas(config, tp)
    assert rep > 1
    by_coords = {r["coords"]: dict(r["grads"]) for r in results}
    checked = 0
    for (t, p, d, c), grads in by_coords.items():
        first = by_coords[(t - t % rep, p, d, c)]
        for name, g in grads.items():
            for a, b in replica_rows(name, config, tp):
                assert torch.equal(g[a:b], first[name][a:b]), (case.name, name, t)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("case", CASES[4], ids=lambda c: c.name)
def test_one_step_on_4_ranks_matches_single_process(case, world4):
    _check_step(case, world4)


@pytest.mark.parametrize("case", CASES[8], ids=lambda c: c.name)
def test_one_step_on_8_ranks_matches_single_process(case, world8):
    _check_step(case, world8)


def test_hf_logits_under_tp_after_convert(world):
    with torch.no_grad():
        want = world["hf"](IDS).logits
    for logits in (r["logits"] for r in world["results"]):
        assert (logits - want).abs().max().item() <= 1e-4
    manifest = read_manifest(world["root"] / "tp")
    assert manifest.layout.tp == world["world"]
    assert manifest.model.num_kv_heads < world["world"]


def test_generation_with_one_kv_head_per_rank_matches_one_process(world):
    single = load_checkpoint(world["root"] / "tp1")
    want = generate_ids(single, PROMPT, 8)
    assert all(r["tokens"] == want for r in world["results"])


def test_saved_checkpoint_holds_each_kv_head_once(world):
    n, path = world["world"], world["root"] / "saved"
    config = _saved_config(n)
    reference = dict(build_model(config, seed=21).named_parameters())
    reader = CheckpointReader(path)
    assert reader.manifest.layout.tp == n
    for name, shape in global_param_shapes(config).items():
        assert torch.equal(reader.global_tensor(name), reference[name].detach()), name
        if "wqkv" not in name:
            continue
        stored = 0
        for file in reader.manifest.weight_map[name]:
            with safe_open(str(Path(path) / file), "pt") as fh:
                stored += fh.get_tensor(name).nbytes
        assert stored == torch.Size(shape).numel() * 4, name  # each q and kv head once
    loaded = load_checkpoint(path)
    assert all(torch.equal(p, reference[k]) for k, p in loaded.named_parameters())
