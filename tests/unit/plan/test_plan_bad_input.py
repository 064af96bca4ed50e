"""`tessera plan` refuses bad and contradictory input with a message that says what is wrong
and what would work, exit code 2 and no traceback: fixed dimensions that do not divide (each
named with its valid values), flags of the other mode, `--recompute-layers` beside another
recomputation, serving constraints no layout meets (with the best reachable), a serving model
that fits nowhere (with the fewest GPUs that hold it, checked against the planner itself).
GPU profiles only: pure Python, no torch, no ranks."""

from __future__ import annotations

import json

import pytest

from tessera.__main__ import main
from tessera.core.config import ModelConfig
from tessera.plan import load_hardware, plan_serving

JOB = ["--model", "llama-1b", "--gpus", "16", "--gpu", "a100-80gb", "--global-batch", "256",
       "--seq-len", "2048"]
SERVE = ["--serve", "--model", "llama-1b", "--gpus", "8", "--gpu", "h100-80gb"]


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, lines", [
    # llama-1b: 16 layers, 16 heads, 8 kv heads, ffn 5632; 8 GPUs a node.
    (["--tp", "3"], ["tp=3: tp 3 x pp 1 x cp 1 = 3 does not divide the 16 GPUs; tp 3 must "
                     "divide the 8 GPUs of a node", "num_heads 16 is not divisible by tp 3",
                     "Valid here: 1, 2, 4, 8"]),
    (["--tp", "16"], ["tp=16: tp 16 must divide the 8 GPUs of a node (tensor parallelism stays "
                      "on NVLink). Valid here: 1, 2, 4, 8"]),
    (["--pp", "5"], ["pp=5: tp 1 x pp 5 x cp 1 = 5 does not divide the 16 GPUs; num_layers 16 "
                     "is not divisible by pp 5", "Valid here: 1, 2, 4, 8, 16"]),
    (["--micro-batch", "3"], ["micro_batch=3: per-data-parallel batch 16 is not divisible by "
                              "micro-batch 3. Valid here: 1, 2, 4, 8, 16"]),
    (["--cp", "3"], ["sequence length 2048 is not divisible by 2 x cp = 6",
                     "Valid here: 1, 2, 4"]),
    (["--ep", "2"], ["ep=2: ", "this model is dense", "Valid here: 1"]),
    (["--virtual-stages", "3"], ["virtual_stages=3: num_layers 16 is not divisible by pp 1 x "
                                 "virtual_stages 3", "Valid here: 1, 2, 4, 8"]),
    (["--tp", "4", "--pp", "4", "--cp", "2"],
     ["  - tp=4: tp 4 x pp 4 x cp 2 = 32 does not divide the 16 GPUs. Valid here: 1, 2\n",
      "  - pp=4: tp 4 x pp 4 x cp 2 = 32 does not divide the 16 GPUs. Valid here: 1, 2\n",
      "  - cp=2: tp 4 x pp 4 x cp 2 = 32 does not divide the 16 GPUs. Valid here: 1\n"]),
], ids=["tp3", "tp16", "pp5", "mb3", "cp3", "ep-dense", "v3", "tp-pp-cp"])
def test_a_fixed_dimension_that_does_not_divide_is_named_with_its_valid_values(
        capsys, argv, lines):
    code, out, err = _plan(capsys, *JOB, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("tessera plan: no valid configuration of llama-1b on 16 GPUs")
    for line in lines:
        assert line in err, (line, err)


def test_fixed_dimensions_at_fault_only_together_are_named_together(capsys):
    # mixtral-tiny: 4 heads, 4 experts. Freeing tp alone leaves ep 8 > 4 experts, freeing
    # ep alone leaves tp 8 > 4 heads: both break rules, said on one line.
    code, _, err = _plan(capsys, "--model", "mixtral-tiny", "--gpus", "8", "--global-batch",
                         "64", "--seq-len", "256", "--tp", "8", "--ep", "8")
    assert code == 2
    assert "  - tp=8, ep=8 together (every other dimension at 1 / off): num_heads 4 is not " \
        "divisible by tp 8" in err
    assert "num_experts 4 is not divisible by ep 8" in err and "Change more than one" in err


@pytest.mark.parametrize("argv, message", [
    ([*JOB, "--recompute", "selective", "--recompute-layers", "2"],
     "--recompute-layers 2 applies to --recompute full only (it recomputes the first N layers "
     "of each stage), not --recompute selective: drop one of them"),
    ([*JOB, "--recompute", "none", "--recompute-layers", "0"], "not --recompute none"),
    ([*JOB, "--recompute-layers", "-1"], "--recompute-layers must be >= 0"),
    ([*JOB, "--recompute-layers", "17"], "--recompute-layers 17 exceeds the model's 16 layers"),
    ([*JOB, "--recompute-layers", "9", "--pp", "2"], "--recompute-layers 9 exceeds the 8 layers "
     "of each of the --pp 2 stages (it counts layers per stage); use at most 8, or leave it out"),
    ([*JOB, "--sequence-parallel", "--tp", "1"], "--sequence-parallel shards activations over "
     "the tensor-parallel group and needs tp > 1, but --tp is 1"),
    ([*JOB, "--virtual-stages", "2", "--pp", "1"], "--virtual-stages 2 interleaves pipeline "
     "stages and needs pp > 1, but --pp is 1"),
    ([*JOB, "--context", "2048", "--concurrency", "4"], "--context, --concurrency are for "
     "--serve only: add --serve to plan inference, or drop them to plan training"),
    ([*JOB, "--max-latency-ms", "5"], "--max-latency-ms is for --serve only"),
    ([*SERVE, "--global-batch", "8", "--micro-batch", "2"], "--global-batch, --micro-batch are "
     "for planning training, not --serve"),
    ([*SERVE, "--seq-len", "2048"], "for serving use --seq-len -> --context"),
    ([*SERVE, "--output", "run.yaml"], "--output is for planning training, not --serve"),
    (["--calibrate", "--serve"], "--calibrate only measures this machine and exits; run it alone"),
    ([*JOB, "--nproc-per-node", "4"], "--nproc-per-node 4 sets the local ranks of --measure; "
     "add --measure, or give the cluster with --gpus"),
], ids=["layers-selective", "layers-none", "layers-negative", "layers-too-many", "layers-past-stage",
        "sp-tp1", "v-pp1", "serving-flags-for-training", "latency-for-training",
        "training-flags-for-serving", "seq-len-for-serving", "output-for-serving",
        "calibrate-serve", "nproc-without-measure"])
def test_contradictory_flags_are_refused_before_planning(capsys, argv, message):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("tessera plan: ") and message in err, err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-latency-ms", "-1", "argument --max-latency-ms: must be > 0, got -1"),
    ("--min-throughput", "0", "argument --min-throughput: must be > 0, got 0"),
    ("--tokens", "abc", "argument --tokens: expected a number (e.g. 300e9), got 'abc'"),
    ("--gpus", "x", "argument --gpus: expected a whole number, got 'x'"),
])
def test_bad_numbers_are_refused_by_the_parser(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *SERVE[1:], flag, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_recompute_layers_alone_means_full_recomputation(capsys):
    code, out, _ = _plan(capsys, *JOB, "--recompute-layers", "2", "--pp", "2", "--json",
                         "--top", "20")
    cands = json.loads(out)["candidates"]
    assert code == 0 and len(cands) == 20
    assert {(c["recompute"], c["recompute_layers"]) for c in cands} == {("full", 2)}


def test_serving_takes_fixed_tp_and_pp_and_names_the_valid_ones(capsys):
    code, out, _ = _plan(capsys, *SERVE, "--tp", "2", "--pp", "2", "--json")
    data = json.loads(out)
    assert code == 0 and {(o["tp"], o["pp"]) for o in data["options"]} == {(2, 2)}
    assert data["recommended"]["replicas"] == 2
    code, out, err = _plan(capsys, *SERVE, "--tp", "3")
    assert code == 2 and out == ""
    assert "no serving layout of llama-1b on 8 GPUs has tp 3: tp must divide the 8-GPU node" \
        in err and "valid (tp, pp): (1, 1), (1, 2)" in err and "(8, 1)" in err


def test_serving_constraints_no_layout_meets_say_what_is_reachable(capsys):
    model, h100 = ModelConfig.from_name("llama-1b"), load_hardware("h100-80gb")
    free = plan_serving(model, 8, h100)
    fastest = min(free.options, key=lambda o: o.time_per_token_s)
    most = max(free.options, key=lambda o: o.tokens_per_s)
    code, out, _ = _plan(capsys, *SERVE, "--max-latency-ms", "0.01", "--min-throughput", "1e9")
    first = out.splitlines()[0]
    assert code == 2
    assert first.startswith("llama-1b (bf16) fits on 8 x h100-80gb, but no layout meets the "
                            "latency / throughput limits (at most 0.01 ms per output token, at "
                            "least 1,000,000,000 tokens/s) at 1 sequence(s) per replica: ")
    assert (f"the fastest, tp {fastest.tp} pp {fastest.pp}, takes "
            f"{fastest.time_per_token_s * 1e3:.2f} ms per token") in first
    assert f"the most tokens/s, tp {most.tp} pp {most.pp}, gives {most.tokens_per_s:,.0f}" \
        in first


def test_serving_that_fits_nowhere_names_the_fewest_gpus_that_hold_it(capsys):
    nemotron, h100 = ModelConfig.from_name("nemotron4-340b"), load_hardware("h100-80gb")
    argv = ["--serve", "--model", "nemotron4-340b", "--gpus", "8", "--gpu", "h100-80gb"]
    code, out, _ = _plan(capsys, *argv)
    assert code == 2 and "16 GPUs would hold it, or FP8 weights" in out.splitlines()[0]
    assert plan_serving(nemotron, 16, h100).fits  # and, whole nodes, nothing in between
    # tp 8 pp 1 fixed: a replica never holds it, however many there are (no endless search).
    code, out, _ = _plan(capsys, *argv, "--tp", "8", "--pp", "1")
    assert code == 2 and "64 GPUs would not hold it either, or FP8 weights" in out
    # The KV cache named when it is what does not fit, with the concurrency that would.
    code, out, _ = _plan(capsys, *argv, "--dtype", "fp8", "--context", "4096", "--concurrency",
                         "200")
    fits = plan_serving(nemotron, 8, h100, precision="fp8", batch=1, context=4096)
    assert code == 2 and "the KV cache of 200 sequence(s) of 4096 tokens" in out
    assert f"or at most {max(o.max_batch for o in fits.options)} concurrent sequences" in out


def test_serving_context_beyond_learned_positions_is_refused(capsys):
    code, _, err = _plan(capsys, "--serve", "--model", "gpt2-small", "--gpus", "1", "--context",
                         "5000")
    assert code == 2 and "context 5000 exceeds gpt2-small's 1024 learned positions; use " \
        "--context <= 1024" in err
