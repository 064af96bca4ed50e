"""`tessera plan` from the command line: help, the ranked table and its JSON, fixed dimensions,
`--output` as a config `tessera pretrain` loads with the planned layout, serving, and the exit
code 2 with a clear message for bad input. GPU profiles only (pure Python, no torch), except
where `--output` is checked against the pretraining config loader."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from tessera.__main__ import main
from tessera.core.config import ModelConfig
from tessera.plan import Fixed, TrainingJob, commands, evaluate, explain, load_hardware, plan_training
from tessera.plan.measure import Measurement
from tessera.plan.report import measured_text, plan_json, plan_text
from tessera.plan.search import MODEL_ERROR, within_model_error

GPU_JOB = ["--model", "llama-1b", "--gpus", "16", "--gpu", "a100-80gb", "--global-batch", "256",
           "--seq-len", "2048"]
FIXING_FLAGS = ("--tp", "--pp", "--virtual-stages", "--cp", "--ep", "--micro-batch",
                "--sequence-parallel", "--recompute", "--recompute-layers")
APPROX = "\u2248"  # the table's mark of a candidate within the model's error of #1
JSON_KEYS = ("tp", "pp", "virtual_stages", "dp", "cp", "ep", "micro_batch", "sequence_parallel",
             "recompute", "recompute_layers", "memory_gib", "step_time_s", "tflops_per_gpu", "mfu")


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_explains_the_modes_and_every_fixing_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (*FIXING_FLAGS, "--json", "--output", "--tokens", "--top", "--calibrate",
                 "--measure", "--nproc-per-node", "--serve", "--gpus-per-node"):
        assert f"{flag} " in text or f"{flag}\n" in text, flag
    assert "a100-40gb" in text and "h200" in text  # the GPU choices
    assert "Korthikanti" in text and "training_days" in text and "Exit codes" in text
    assert "within_model_error" in text and f"({100 * MODEL_ERROR:.1f}%, its worst" in text
    assert "--measure-worker" not in text  # the ranks' entry point is not for people


def test_table_ranks_the_api_candidates_and_breaks_down_the_best(capsys):
    code, out, _ = _plan(capsys, *GPU_JOB, "--top", "4", "--tokens", "100e9")
    assert code == 0
    job = TrainingJob(ModelConfig.from_name("llama-1b"), gpus=16,
                      hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=2048,
                      tokens=100e9)
    expected = plan_training(job, Fixed())
    lines = out.splitlines()
    assert f"{len(expected):,} configurations fit; the 4 fastest" in out
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    assert lines[head].split()[-1] == "days" and set(lines[head + 1]) <= {" ", "-"}
    rows = lines[head + 2:head + 6]
    for rank, (row, c) in enumerate(zip(rows, expected), start=1):
        cells = row.split()
        mark = "*" if rank == 1 else "\u2248" if within_model_error(expected[0], c) else ""
        assert cells[0] == f"{rank}{mark}"
        assert " ".join(cells[1:1 + len(c.layout.split())]) == c.layout
        assert f"{c.step_time_s:#.3g}" in row and f"{c.memory_gib:.1f} / 80" in row
        assert f"{100 * c.mfu:.1f}%" in row and f"{c.days:.1f}" == cells[-1]
    assert lines[head + 6].startswith("  \u2248 #1 is predicted at most 6.5% faster")
    assert lines[head + 7] == ""  # exactly --top rows, then the legend
    best = expected[0]
    assert f"best: {best.layout}, micro-batch {best.micro_batch} x {best.micro_batches}" in out
    assert f"memory per GPU  {best.memory_gib:.2f} GiB of 80.0: weights" in out
    assert f"step time       {best.step_time_s:#.3g} s: compute" in out
    assert f"training time   {best.days:.1f} days for 100.0B tokens" in out
    assert "why #1: " in out


def test_json_is_one_object_best_first_with_the_documented_keys(capsys):
    code, out, _ = _plan(capsys, *GPU_JOB, "--top", "3", "--json", "--gpus-per-node", "4")
    assert code == 0
    data = json.loads(out)  # one object, nothing else on stdout
    assert set(data) == {"candidates", "training_days"} and data["training_days"] is None
    cands = data["candidates"]
    assert [c["rank"] for c in cands] == [1, 2, 3]
    assert all(k in c for c in cands for k in JSON_KEYS)
    times = [c["step_time_s"] for c in cands]
    assert times == sorted(times)
    assert all(c["tp"] <= 4 for c in cands)  # --gpus-per-node bounds tp
    assert all(c["tp"] * c["pp"] * c["cp"] * c["dp"] == 16 for c in cands)
    code, out, _ = _plan(capsys, *GPU_JOB, "--top", "1", "--json", "--tokens", "1e9")
    best = json.loads(out)["candidates"][0]
    assert json.loads(out)["training_days"] == pytest.approx(1e9 / best["tokens_per_s"] / 86400)


def test_flags_fix_dimensions(capsys):
    code, out, _ = _plan(capsys, *GPU_JOB, "--json", "--top", "50", "--tp", "2", "--pp", "2",
                         "--micro-batch", "2", "--recompute", "selective",
                         "--sequence-parallel", "--cp", "1")
    assert code == 0
    cands = json.loads(out)["candidates"]
    assert cands and all((c["tp"], c["pp"], c["micro_batch"], c["recompute"],
                          c["sequence_parallel"], c["cp"], c["dp"]) ==
                         (2, 2, 2, "selective", True, 1, 4) for c in cands)
    assert {c["virtual_stages"] for c in cands} == {1, 2, 4, 8}  # the one dimension left
    code, out, _ = _plan(capsys, *GPU_JOB, "--json", "--tp", "2", "--pp", "2", "--cp", "1",
                         "--virtual-stages", "2", "--micro-batch", "2", "--recompute", "full",
                         "--recompute-layers", "1", "--sequence-parallel", "false")
    (one,) = json.loads(out)["candidates"]  # every dimension fixed: one configuration
    assert (one["virtual_stages"], one["recompute_layers"], one["sequence_parallel"]) == \
        (2, 1, False)


def test_output_is_a_pretrain_config_with_the_planned_layout(capsys, tmp_path):
    from tessera.core.config import Layout, TrainSchedule
    from tessera.core.parallel.pipeline import validate_training
    from tessera.training.config import load_config

    path = tmp_path / "run.yaml"
    code, out, _ = _plan(capsys, *GPU_JOB, "--cp", "1", "--pp", "2", "--model-overrides",
                         "num_layers=8", "--tokens", "1e9", "--output", str(path), "--json")
    assert code == 0, out
    best = json.loads(out)["candidates"][0]
    cfg, _ = load_config(["--config", str(path)])
    assert cfg.parallel.layout() == Layout(
        tp=best["tp"], pp=2, virtual_stages=best["virtual_stages"], dp=best["dp"],
        sequence_parallel=best["sequence_parallel"])
    assert cfg.parallel.train_schedule() == TrainSchedule(
        schedule="interleaved-1f1b" if best["virtual_stages"] > 1 else "1f1b",
        micro_batches=256 // (best["dp"] * best["micro_batch"]), recompute=best["recompute"],
        recompute_layers=best["recompute_layers"],
        data_parallel="zero1" if best["sharded_optimizer"] else "ddp")
    assert cfg.model == ModelConfig.from_name("llama-1b", num_layers=8)
    assert (cfg.train.global_batch, cfg.train.seq_len, cfg.train.precision) == (256, 2048, "bf16")
    assert cfg.train.steps == -(-1_000_000_000 // (256 * 2048))
    # What `tessera pretrain` checks (training.loop.check_config) before starting 16 ranks.
    validate_training(cfg.model, cfg.parallel.layout(), cfg.parallel.train_schedule(),
                      world_size=16, global_batch=256, seq_len=2048)
    assert path.read_text().startswith("# Planned by `tessera plan` for 16 x a100-80gb")


def test_output_carries_cp_and_ep(capsys, tmp_path):
    import yaml

    from tessera.plan.run_config import parallel_section
    from tessera.training.config import load_config

    path = tmp_path / "run.yaml"
    code, out, _ = _plan(capsys, *GPU_JOB, "--cp", "2", "--output", str(path), "--json")
    assert code == 0, out
    cfg, _ = load_config(["--config", str(path)])
    assert cfg.parallel.layout().cp == 2 == json.loads(out)["candidates"][0]["cp"]
    # Layout has expert parallelism: a plan that needs it is written as is,
    # and pretraining reads it back.
    assert parallel_section({"tp": 1, "ep": 2}) == {"tp": 1, "ep": 2, "cp": 1}
    path.write_text(yaml.safe_dump({"parallel": parallel_section({"dp": 2, "ep": 2})}))
    cfg, _ = load_config(["--config", str(path)])
    assert cfg.parallel.layout().ep == 2


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "64",
      "--seq-len", "2048"], "would fit"),
    (["--model", "llama-1b", "--gpus", "12", "--gpu", "h100-80gb", "--global-batch", "48",
      "--seq-len", "2048"], "not a whole number of 8-GPU nodes; use 8 or 16, or give the GPUs a "
     "node really has (gpus_per_node; --gpus-per-node on the command line)"),
    (["--serve", "--model", "llama-1b", "--gpus", "12", "--gpu", "h100-80gb"],
     "12 GPUs is not a whole number of 8-GPU nodes; use 8 or 16"),
    (["--model", "llama-1b", "--gpus", "8", "--seq-len", "2048"], "needs --global-batch"),
    (["--model", "no-such-model", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"],
     "unknown model preset 'no-such-model'"),
    (["--model", "llama-1b", "--gpus", "8", "--global-batch", "8", "--seq-len", "2048",
      "--tp", "3"], "(fixed: tp=3)"),
], ids=["does-not-fit", "partial-node", "serve-partial-node", "no-batch", "unknown-model", "bad-tp"])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, out, err = _plan(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("tessera plan: ") and message in err and "Traceback" not in err


def test_a_missing_calibration_file_is_refused_not_measured(capsys, tmp_path):
    typo = tmp_path / "cpu-calibraton.json"
    code, out, err = _plan(capsys, "--gpu", "cpu", "--calibration-file", str(typo), "--model",
                           "llama-tiny", "--gpus", "2", "--global-batch", "8", "--seq-len", "64")
    assert code == 2 and out == ""
    assert f"--calibration-file {typo} does not exist: make it with `tessera plan --calibrate " \
        f"--calibration-file {typo}`" in err
    assert not typo.exists()  # nothing measured, nothing written


def test_a_json_hardware_profile_plans_like_the_built_in_one(capsys, tmp_path):
    profile = tmp_path / "my-h100.json"
    fields = dataclasses.asdict(load_hardware("h100-80gb"))
    profile.write_text(json.dumps({**fields, "name": "my-h100"}))
    job = ["--model", "llama-1b", "--gpus", "16", "--global-batch", "256", "--seq-len", "2048",
           "--top", "3"]
    _, built_in, _ = _plan(capsys, *job, "--gpu", "h100-80gb", "--json")
    code, custom, _ = _plan(capsys, *job, "--gpu", str(profile), "--json")
    assert code == 0 and json.loads(custom) == json.loads(built_in)
    out = tmp_path / "run.yaml"
    code, text, _ = _plan(capsys, *job, "--gpu", str(profile), "--output", str(out))
    assert code == 0 and text.startswith("tessera plan: llama-1b on 16 x my-h100 (")
    assert out.read_text().startswith("# Planned by `tessera plan` for 16 x my-h100: ")
    profile.write_text(json.dumps({**fields, "hbm_gib": 80}))
    code, _, err = _plan(capsys, *job, "--gpu", str(profile))
    assert code == 2 and "unknown hardware fields ['hbm_gib']" in err
    code, _, err = _plan(capsys, *job, "--gpu", str(tmp_path / "missing.json"))
    assert code == 2 and f"no hardware profile at {tmp_path / 'missing.json'}" in err


def test_unknown_gpu_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *GPU_JOB[:4], "--gpu", "v100"])
    assert exc.value.code == 2
    assert "invalid choice: 'v100'" in capsys.readouterr().err


def test_serving_says_plainly_what_fits(capsys):
    argv = ["--serve", "--model", "nemotron4-340b", "--gpus", "8", "--gpu", "h100-80gb"]
    code, out, _ = _plan(capsys, *argv, "--precision", "bf16")
    assert code == 2 and "does not fit on 8 x h100-80gb" in out.splitlines()[0]
    code, out, _ = _plan(capsys, *argv, "--dtype", "fp8", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["recommended"]["tp"] * data["recommended"]["pp"] \
        * data["recommended"]["replicas"] == 8


def test_cpu_profile_shares_the_machine_between_its_ranks(capsys, tmp_path):
    calibration = tmp_path / "cpu.json"
    calibration.write_text(json.dumps({"gemm_tflops": 0.08, "allreduce_gbps": 1.0,
                                       "memory_gib": 16.0, "cores": 2}))
    code, out, _ = _plan(capsys, "--gpu", "cpu", "--calibration-file", str(calibration),
                         "--model", "llama-tiny", "--gpus", "4", "--global-batch", "16",
                         "--seq-len", "64", "--top", "2")
    assert code == 0
    assert out.startswith("tessera plan: llama-tiny on 4 x cpu (4.0 GiB, 4 per node), global "
                          "batch 16 x 64 tokens, fp32")
    # The band is the error on GPU runs; the legend says the CPU model is less sure.
    assert "within the model's error on published GPU runs; larger on CPU ranks (" in out
    code, _, err = _plan(capsys, "--gpu", "cpu", "--calibration-file", str(calibration),
                         "--model", "llama-tiny", "--gpus", "4", "--global-batch", "16",
                         "--seq-len", "64", "--measure", "--nproc-per-node", "2")
    assert code == 2 and "--gpus (4) must equal --nproc-per-node (2)" in err
    # The fixed per-op costs are shared too: 4 ranks on 2 cores pay each twice. By hand for
    # llama-tiny (2 layers), micro-batch 4 x 1 on dp 4, no recompute: 2 x (2 layers x 3 x
    # 1000 us + 500 us) = 13 ms more a step.
    one = ("--gpu", "cpu", "--calibration-file", str(calibration), "--model", "llama-tiny",
           "--gpus", "4", "--global-batch", "16", "--seq-len", "64", "--tp", "1", "--pp", "1",
           "--micro-batch", "4", "--recompute", "none", "--sequence-parallel", "off",
           "--json", "--top", "1")
    code, out, _ = _plan(capsys, *one)
    base = json.loads(out)["candidates"][0]["step_time_s"]
    calibration.write_text(json.dumps({"gemm_tflops": 0.08, "allreduce_gbps": 1.0,
                                       "memory_gib": 16.0, "cores": 2,
                                       "layer_overhead_us": 1000, "microbatch_overhead_us": 500}))
    code, out, _ = _plan(capsys, *one)
    assert json.loads(out)["candidates"][0]["step_time_s"] - base == pytest.approx(0.013)
    # As are the cores' GEMM rate and memory bandwidth (memory-bound ops run on them too).
    from tessera.plan.commands import _hardware

    args = argparse.Namespace(gpu="cpu", calibration_file=str(calibration))
    alone, shared = _hardware(args, 2), _hardware(args, 4)
    assert shared.peak("fp32") == pytest.approx(alone.peak("fp32") / 2)
    assert shared.memory_gbps == pytest.approx(alone.memory_gbps / 2)
    # CPU ranks run Tessera's loop, which averages gradients after the backward: the dp
    # reduction is on the step, as the API computes it with overlap_grad_reduce=False.
    cand = json.loads(out)["candidates"][0]
    job = TrainingJob(ModelConfig.from_name("llama-tiny"), gpus=4, hardware=shared,
                      global_batch=16, seq_len=64, gpus_per_node=4, precision="fp32",
                      overlap_grad_reduce=False)
    by_api = evaluate(job, {k: cand[k] for k in ("tp", "pp", "micro_batch", "recompute",
                                                 "sequence_parallel")})
    assert cand["dp"] == 4 and by_api.time.dp > 0
    assert cand["time"]["dp"] == pytest.approx(by_api.time.dp)


def test_measured_table_puts_the_rankings_side_by_side():
    job = TrainingJob(ModelConfig.from_name("llama-1b"), gpus=16,
                      hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=2048)
    cands = plan_training(job, Fixed(cp=1), top=3)
    measured = [Measurement(True, 0.5, 1000.0, 1.25, [0.5, 0.5]),
                Measurement(False, error="rank 1: RuntimeError: out of memory"),
                Measurement(True, 0.25, 2000.0, 1.5, [0.25])]
    text = measured_text(cands, measured, -1.0, "test setting").splitlines()
    assert text[0] == "measured: test setting"
    assert text[2].split() == ["predicted", "#", "layout", "micro-batch", "recompute",
                               "predicted", "s", "measured", "#", "measured", "s", "tokens/s",
                               "peak", "GiB"]
    rows = [line.split() for line in text[4:7]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert rows[0][-4:] == ["2", "0.5000", "1,000", "1.25"]
    assert rows[1][-4:] == ["failed", "-", "-", "-"]
    assert rows[2][-4:] == ["1", "0.2500", "2,000", "1.50"]
    assert "  #2 failed: rank 1: RuntimeError: out of memory" in text
    assert any(line.startswith("measured best: predicted #3") for line in text)
    assert text[-1] == ("Spearman rank correlation, predicted vs measured step time: -1.00 "
                        "over 2 candidates")


def test_measure_runs_every_candidate_cp_included(
        capsys, monkeypatch, tmp_path):
    """No ranks here: the runner is replaced by one that records what it was given."""
    from tessera.plan import measure

    seen = {}

    def fake_measure_all(configs, workdir, data, **kw):
        seen["configs"], seen["kw"] = configs, kw
        return [Measurement(True, 1.0 + i, 100.0, 1.0, [1.0 + i]) for i in range(len(configs))]

    monkeypatch.setattr(measure, "measure_all", fake_measure_all)
    monkeypatch.setattr(commands, "_local_gpus", lambda: 64)  # as on a GPU cluster
    monkeypatch.setattr(measure, "synthetic_data", lambda directory, vocab, tokens: tmp_path)
    code, out, _ = _plan(capsys, "--model", "llama3-8b", "--gpu", "h100-80gb", "--global-batch",
                         "512", "--seq-len", "8192", "--measure", "--nproc-per-node", "64",
                         "--top", "5", "--json", "--measure-steps", "3")
    assert code == 0
    cands = json.loads(out)["candidates"]
    with_cp = [c for c in cands if c["cp"] > 1]
    assert with_cp and len(with_cp) < len(cands)  # the search puts both kinds in the top 5
    assert [c["measured"]["step_time_s"] for c in cands] == [1.0 + i for i in range(len(cands))]
    assert [(cfg["parallel"]["tp"], cfg["parallel"]["cp"]) for cfg in seen["configs"]] == \
        [(c["tp"], c["cp"]) for c in cands]
    assert seen["kw"]["nproc"] == 64 and seen["kw"]["device"] == "cuda"
    assert seen["kw"]["steps"] == 3 and seen["kw"]["warmup"] == 2


def test_candidates_within_the_model_error_are_marked_in_table_json_and_why(capsys):
    """The band: #1 predicted at most MODEL_ERROR faster (tokens/s ratio). Marked `≈` in the
    table with a legend counting them among all that fit, `within_model_error` in the JSON
    (true for #1), and said in the "why #1" line when the runner-up is in it."""
    job = TrainingJob(ModelConfig.from_name("llama-1b"), gpus=16,
                      hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=2048)
    ranked = plan_training(job, Fixed())
    best = ranked[0]
    inside = [c.tokens_per_s * (1 + MODEL_ERROR) >= best.tokens_per_s for c in ranked]
    assert inside[0] and inside[1] and not all(inside[:30])  # both kinds among the top 30
    code, out, _ = _plan(capsys, *GPU_JOB, "--top", "30", "--json")
    cands = json.loads(out)["candidates"]
    assert code == 0 and [c["within_model_error"] for c in cands] == inside[:30]
    code, out, _ = _plan(capsys, *GPU_JOB, "--top", "30")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    marks = [line.split()[0] for line in lines[head + 2:head + 32]]
    assert marks == [f"{i + 1}{'*' if i == 0 else APPROX if inside[i] else ''}"
                     for i in range(30)]
    assert lines[head + 32] == (
        f"  \u2248 #1 is predicted at most 6.5% faster, within the model's error on published "
        f"runs ({sum(inside)} of the {len(ranked):,} configurations, #1 included): too close "
        "to call, measure them (--measure) to decide")
    assert "; within the model's 6.5% error: too close to call, measure both" in out
    # A runner-up outside the band: no such clause, and no legend without a mark.
    far = dataclasses.replace(ranked[1], tokens_per_s=best.tokens_per_s / (1 + MODEL_ERROR)
                              * 0.999)
    edge = dataclasses.replace(ranked[1], tokens_per_s=best.tokens_per_s / (1 + MODEL_ERROR)
                               * 1.001)
    assert within_model_error(best, best) and within_model_error(best, edge)
    assert not within_model_error(best, far) and "within" not in explain(best, far)
    assert "within the model's 6.5% error" in explain(best, edge)
    text = plan_text("header", [best, far], 2, None, None)
    assert "\u2248" not in text and text.splitlines()[6].split()[0] == "2"
    assert plan_json([best, far])["candidates"][1]["within_model_error"] is False


def test_tie_mark_falls_back_to_ascii_on_a_latin1_stdout(monkeypatch):
    import io
    import sys

    from tessera.plan.report import tie_mark

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="latin-1"))
    assert tie_mark() == "~"


def test_a_short_run_is_timed_in_hours_or_seconds_not_zero_days(capsys):
    job = TrainingJob(ModelConfig.from_name("llama-1b"), gpus=16,
                      hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=2048,
                      tokens=1e9)
    fix = ("--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "8")
    best = plan_training(job, Fixed(tp=1, pp=1, cp=1, micro_batch=8), top=1)[0]
    code, out, _ = _plan(capsys, *GPU_JOB, *fix, "--tokens", "1e9", "--top", "1")
    assert code == 0 and best.days < 1 / 24  # 1B tokens at ~530K tokens/s: ~31 minutes
    assert f"training time   {best.days * 1440:.1f} minutes for 1.0B tokens" in out
    code, out, _ = _plan(capsys, *GPU_JOB, *fix, "--tokens", "1e12", "--top", "1")
    assert f"training time   {best.days * 1000:.1f} days for 1.0T tokens" in out


def test_fp8_tflops_print_whole_not_in_exponent_form(capsys):
    # H200 fp8 runs above 1,000 TFLOP/s per GPU; `.3g` alone would print 1.15e+03.
    code, out, _ = _plan(capsys, "--model", "llama3-8b", "--gpus", "16", "--gpu", "h200",
                         "--global-batch", "64", "--seq-len", "8192", "--precision", "fp8",
                         "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "2",
                         "--recompute", "none", "--json")
    tflops = json.loads(out)["candidates"][0]["tflops_per_gpu"]
    assert code == 0 and tflops > 1000
    code, out, _ = _plan(capsys, "--model", "llama3-8b", "--gpus", "16", "--gpu", "h200",
                         "--global-batch", "64", "--seq-len", "8192", "--precision", "fp8",
                         "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "2",
                         "--recompute", "none")
    assert f" {tflops:,.0f} " in out and "e+0" not in out


def test_a_reader_that_leaves_early_is_not_an_error():
    """`tessera plan --json | head`: the reader closes the pipe before the plan is written.
    Exit 0 and no BrokenPipeError traceback (the closed pipe is the reader's choice; handled
    for every verb in `tessera/__main__.py`)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera", "plan", *GPU_JOB, "--tp", "1", "--pp", "1", "--cp",
         "1", "--micro-batch", "8", "--recompute", "none", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the child writes: its write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_one_configuration_is_counted_in_the_singular(capsys):
    code, out, _ = _plan(capsys, *GPU_JOB, "--tp", "2", "--pp", "2", "--virtual-stages", "2",
                         "--cp", "1", "--micro-batch", "2", "--sequence-parallel", "--recompute",
                         "full", "--recompute-layers", "2")
    assert code == 0 and out.splitlines()[1] == "1 configuration fits:"
    assert "why #1" not in out and "\u2248" not in out  # nothing to compare it with


def test_the_tie_legend_points_to_the_measured_ranking_when_measuring(
        capsys, monkeypatch, tmp_path):
    """With --measure the measurements follow the table: the legend says they decide, instead
    of suggesting --measure again."""
    from tessera.plan import measure

    monkeypatch.setattr(measure, "measure_all", lambda configs, workdir, data, **kw: [
        Measurement(True, 1.0 + i, 100.0, 1.0, [1.0 + i]) for i in range(len(configs))])
    monkeypatch.setattr(measure, "synthetic_data", lambda directory, vocab, tokens: tmp_path)
    monkeypatch.setattr(commands, "_local_gpus", lambda: 64)  # as on a GPU cluster
    code, out, _ = _plan(capsys, "--model", "llama3-8b", "--gpu", "h100-80gb", "--global-batch",
                         "512", "--seq-len", "8192", "--measure", "--nproc-per-node", "64",
                         "--top", "3", "--measure-steps", "3")
    legend = next(line for line in out.splitlines() if line.startswith(f"  {APPROX} #1 is"))
    assert code == 0 and legend.endswith("too close to call, the measured ranking below decides")
    assert out.index(legend) < out.index("measured: ")
    code, out, _ = _plan(capsys, "--model", "llama3-8b", "--gpu", "h100-80gb", "--global-batch",
                         "512", "--seq-len", "8192", "--gpus", "64", "--top", "3")
    assert "too close to call, measure them (--measure) to decide" in out


def test_output_that_cannot_be_written_is_a_clear_error(capsys, tmp_path):
    code, out, err = _plan(capsys, *GPU_JOB, "--top", "1", "--output", str(tmp_path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == (f"tessera plan: --output {tmp_path} is a directory; give the YAML file to "
                   f"write, e.g. --output {tmp_path / 'run.yaml'}\n")
    blocker = tmp_path / "file"
    blocker.write_text("")  # a parent that is a file: the OS refuses to create the YAML
    code, out, err = _plan(capsys, *GPU_JOB, "--top", "1", "--output", str(blocker / "run.yaml"))
    assert code == 2 and out == "" and err.startswith(f"tessera plan: cannot write --output "
                                                      f"{blocker / 'run.yaml'}: ")


def test_measure_on_gpus_this_machine_lacks_is_refused_before_running(capsys, monkeypatch):
    from tessera.plan import measure

    def never(*args, **kw):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(measure, "measure_all", never)
    monkeypatch.setattr(commands, "_local_gpus", lambda: 0)
    code, out, err = _plan(capsys, "--model", "llama-tiny", "--gpu", "a100-80gb",
                           "--global-batch", "8", "--seq-len", "64", "--measure",
                           "--nproc-per-node", "2", "--top", "1")
    assert code == 2 and out == "" and err == (
        "tessera plan: --measure --gpu a100-80gb runs 2 ranks on this machine's GPUs, but it has "
        "0; measure with --gpu cpu (gloo ranks on this CPU), or run it on a machine with 2 GPUs\n")
