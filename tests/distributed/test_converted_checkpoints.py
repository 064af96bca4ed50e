"""A checkpoint resharded by `tessera convert` loads under its new layout on gloo and gives the
logits of the single-process original (plain and FP8)."""

import torch

from tessera.converters.reshard import reshard_checkpoint
from tessera.core import Layout, ModelConfig, build_model, load_checkpoint, save_checkpoint
from tessera.core.checkpoint import load_weights, read_manifest
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import build_stages
from tessera.core.parallel.pipeline_forward import pipeline_forward
from tests.distributed_helper import run_ranks

IDS = torch.arange(2 * 12).reshape(2, 12) * 37 % 1003


def _logits_under_layout(rank: int, world: int, path: str, tp: int, pp: int):
    manifest = read_manifest(path)
    par = Layout(tp=tp, pp=pp)
    groups = init_groups(par)
    stages = build_stages(manifest.model, par, groups, init=False) if pp > 1 else [
        build_model(manifest.model, par, groups, init=False)]
    load_weights(stages, path)
    for m in stages:
        m.eval()
    out = pipeline_forward(stages, groups, IDS) if pp > 1 else stages[0](IDS)
    return None if out is None else out.detach()


def test_resharded_checkpoints_load_under_their_layout(tmp_path):
    config = ModelConfig.from_name("llama-tiny", vocab_size=1003, num_layers=4)
    src = save_checkpoint(tmp_path / "tp1", build_model(config, seed=11))
    reference = load_checkpoint(src)(IDS)
    for tp, pp in ((2, 1), (2, 2)):
        dst = tmp_path / f"tp{tp}pp{pp}"
        reshard_checkpoint(src, dst, tp=tp, pp=pp, progress=False)
        outs = run_ranks(_logits_under_layout, tp * pp, str(dst), tp, pp, timeout=120)
        got = [o for o in outs if o is not None]
        assert got, "no rank returned logits"
        for logits in got:
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_fp8_checkpoint_under_tp2_matches_its_single_process_load(tmp_path):
    config = ModelConfig.from_name("gpt2-tiny", vocab_size=1003)
    src = save_checkpoint(tmp_path / "tp1", build_model(config, seed=12))
    dst = tmp_path / "fp8-tp2"
    reshard_checkpoint(src, dst, tp=2, fp8=True, progress=False)
    single = load_checkpoint(dst)(IDS)
    assert (single - load_checkpoint(src)(IDS)).abs().max() < 0.1  # FP8 moves logits a little
    for logits in run_ranks(_logits_under_layout, 2, str(dst), 2, 1, timeout=120):
        torch.testing.assert_close(logits, single, atol=1e-5, rtol=1e-5)
