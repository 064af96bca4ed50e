"""`tessera pretrain --precision fp8` on CPU (the emulated backend): a 20-step run follows the
bf16 run, its recipe and amax history are saved in the checkpoints, resume is bit-identical,
and FP8 choices that cannot run are clear errors.

Tolerance of the loss comparison, from the formats: e4m3 keeps 3 mantissa bits, so rounding
moves a value by at most half its step, 2**-4 relative, and uniformly: RMS 2**-4 / sqrt(3) =
0.036 (e5m2 gradients: 0.072). A product of n terms with independent rounding errors carries
about the same relative RMS error (it adds in quadrature like the terms do): ~0.05 per FP8
linear (input and weight), which reaches the logits z as a perturbation dz of RMS <= 0.05 |z|
with random sign. The loss moves by the mean over the T = 256 tokens of (p - y) . dz, where
|p - y| <= sqrt(2): 0.05 * sqrt(2) |z| / sqrt(T) ~ 4e-3 |z|, about 1e-3 of a loss of ~4-6 with
|z| ~ 1 (plus a second-order mean shift ~dz**2 / 2, smaller). Over the steps, the FP8
gradients (RMS error <= 0.072 relative) change each AdamW update by that fraction with random
sign; the runs drift apart by about 0.072 * sqrt(steps) of one step's loss decrease (~0.1 here),
i.e. 0.072 * sqrt(20) * 0.1 / 4 ~ 8e-3 relative at worst. The bound, 1e-2, is the sum of the
two and the 1 % the GPU target allows over 50 steps; a broken scale is far outside it (an
unscaled e4m3 cast of these 0.02-sized weights loses most of them; a wrong gradient format or a
missing dequantization moves the loss by 10 % or more within a few steps). Every recipe the
emulated backend offers (delayed, tensorwise, rowwise) is held to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tessera.training import cli
from tessera.training.config import load_config
from tessera.training.loop import pretrain
from tests.pretrain_helper import TinyData, pretrain_argv, read_losses, rewind_run

STEPS = 20
MAX_RELATIVE_DIFF = 1e-2
HISTORY = 8  # short, so 20 steps roll the window


def _argv(tiny: TinyData, run: Path, *extra: str) -> list[str]:
    # ffn 128: every block linear has dimensions that are multiples of 16, so all are FP8
    return pretrain_argv(tiny, run, "--model-overrides", f"vocab_size={tiny.vocab_size}",
                         "num_layers=2", "ffn_hidden_size=128", "--steps", str(STEPS),
                         "--save-interval", "8", "--keep-last", "3", *extra)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def runs(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    fp8 = ["--precision", "fp8"]
    for name, flags in [("bf16", ["--precision", "bf16"]),
                        ("fp8", [*fp8, "--fp8-amax-history-len", str(HISTORY)]),
                        ("fp8-tensorwise", [*fp8, "--fp8-recipe", "tensorwise"]),
                        ("fp8-rowwise", [*fp8, "--fp8-recipe", "rowwise"])]:
        run = tmp_path_factory.mktemp(name) / "run"
        cfg, _ = load_config(_argv(tiny, run, *flags))
        pretrain(cfg)
        out[name] = run
    return out


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_fp8_loss_follows_bf16(runs, recipe):
    bf16 = read_losses(runs["bf16"])
    fp8 = read_losses(runs["fp8" if recipe == "delayed" else f"fp8-{recipe}"])
    assert sorted(fp8) == list(range(1, STEPS + 1))
    rel = [abs(fp8[s] - bf16[s]) / bf16[s] for s in fp8]
    print(f"\nstep  bf16     fp8 (emulated, {recipe})  rel. diff")
    for s in fp8:
        print(f"{s:4d}  {bf16[s]:.5f}  {fp8[s]:.5f}  {rel[s - 1]:+.2e}")
    assert max(rel) < MAX_RELATIVE_DIFF, f"max per-step relative difference {max(rel):.2e}"
    assert max(rel) > 0  # FP8 really ran: bf16 and FP8 products differ
    assert fp8[STEPS] < 0.75 * fp8[1]  # and it learns


def test_recipe_and_amax_history_are_saved(runs, capsys):
    ckpt = runs["fp8"] / "checkpoints" / f"step-{STEPS:08d}"
    record = json.loads((ckpt / "manifest.json").read_text())["extra"]["training"]["fp8"]
    assert record == {"backend": "emulated", "recipe": "delayed", "fp8_format": "hybrid",
                      "amax_history_len": HISTORY, "margin": 0, "amax_compute_algo": "max",
                      "emulate": False, "fp8_layers": 8, "bf16_fallback": []}
    state = load_file(str(ckpt / "training" / "fp8-rank00000.safetensors"))
    assert len(state) == 2 * 8
    history = state["layers.1.feed_forward.w2.amax_history"]
    scale = state["layers.1.feed_forward.w2.scale"]
    assert history.shape == (HISTORY, 3) and scale.shape == (3,)
    assert (history[0] == 0).all() and (history[1:] > 0).all()  # a full, rolled window
    # The scales were set from the whole window, whose oldest row the roll has since dropped:
    # at most fp8_max over what is still visible (the exact rule: tests/unit/core).
    top = [448.0, 448.0, 57344.0]
    for k in range(3):
        assert 0 < scale[k].item() <= top[k] / history[1:, k].max().item() * (1 + 1e-6)


def test_resume_is_bit_identical(tiny, runs, tmp_path, capsys):
    """Steps 1-16, save, then 17-20 resumed equal the straight run's bit for bit: weights,
    moments and the FP8 amax history and scales all come back."""
    part = tmp_path / "part"
    rewind_run(runs["fp8"], part, 16)
    cfg, _ = load_config(_argv(tiny, part, "--precision", "fp8", "--fp8-amax-history-len",
                               str(HISTORY), "--resume"))
    pretrain(cfg)
    out = capsys.readouterr().out
    assert "resumed from" in out and "starts afresh" not in out
    assert "fp8 via emulated on Tessera's own path, recipe delayed" in out  # the banner
    full, resumed = read_losses(runs["fp8"]), read_losses(part)
    assert sorted(resumed) == list(range(17, STEPS + 1))
    assert [resumed[s] for s in resumed] == [full[s] for s in resumed]


@pytest.mark.parametrize(("flags", "message"), [
    (["--fp8-backend", "te"], "needs a CUDA device and Transformer Engine"),
    (["--fp8-recipe", "block"], "needs a CUDA device"),
    (["--fp8-recipe", "mxfp8", "--fp8-backend", "emulated"], "offers the recipes"),
])
def test_fp8_choices_that_cannot_run_are_clear_errors(tiny, tmp_path, capsys, flags, message):
    assert cli.main(_argv(tiny, tmp_path / "run", "--precision", "fp8", *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera pretrain: ") and message in err, err
