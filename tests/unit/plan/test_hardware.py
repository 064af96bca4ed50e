"""Hardware profiles: datasheet values, the cpu calibration file, JSON profiles, bad names."""

from __future__ import annotations

import json

import pytest

from tessera.plan import PROFILES, Hardware, PlanError, load_hardware


def test_datasheet_profiles():
    # Dense Tensor Core peaks (datasheet numbers with sparsity halved) and HBM sizes.
    assert PROFILES["a100-80gb"].peak("bf16") == 312.0
    assert PROFILES["h100-80gb"].peak("bf16") == 989.5
    assert PROFILES["h100-80gb"].peak("fp8") == 1979.0
    assert PROFILES["h200"].memory_gib > 140 > PROFILES["h100-80gb"].memory_gib
    assert "fp8" not in PROFILES["a100-40gb"].peak_tflops
    with pytest.raises(PlanError, match="a100-40gb has no fp8 peak"):
        PROFILES["a100-40gb"].peak("fp8")


def test_gemm_fraction_shape_rule():
    hw = Hardware("x", {"bf16": 100.0}, 10, 1000, 100, 10, gemm_efficiency=0.7,
                  gemm_half_size=96)
    # d / (d + 96) of 0.7: a 96-wide GEMM runs at 0.35, a 4000-wide one at 0.7 * 4000/4096.
    assert hw.gemm_fraction(4096, 96, 4096) == pytest.approx(0.35)
    assert hw.gemm_fraction(4000, 8192, 8192) == pytest.approx(0.7 * 4000 / 4096)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(PlanError) as err:
        load_hardware("v100")
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"):
        assert name in str(err.value)


def test_cpu_needs_a_calibration(tmp_path):
    with pytest.raises(PlanError, match="run `tessera plan --calibrate`"):
        load_hardware("cpu", calibration=tmp_path / "missing.json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"gemm_tflops": 0.5}))
    with pytest.raises(PlanError, match=r"lacks numbers for \['allreduce_gbps', 'memory_gib'\]"):
        load_hardware("cpu", calibration=partial)


def test_cpu_profile_from_calibration(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"gemm_tflops": 0.4, "allreduce_gbps": 2.5, "memory_gib": 16}))
    hw = load_hardware("cpu", calibration=path)
    assert hw.peak("fp32") == hw.peak("bf16") == 0.4
    assert hw.intra_node_gbps == hw.inter_node_gbps == 2.5
    assert hw.memory_gib == 16
    # Measured rates are achieved rates: no efficiency discount, no shape penalty.
    assert hw.gemm_fraction(8, 8, 8) == 1.0
    assert hw.layer_overhead_us == hw.microbatch_overhead_us == 0.0  # not measured: none
    path.write_text(json.dumps({"gemm_tflops": 0.4, "allreduce_gbps": 2.5, "memory_gib": 16,
                                "layer_overhead_us": 900, "microbatch_overhead_us": 300}))
    hw = load_hardware("cpu", calibration=path)
    assert (hw.layer_overhead_us, hw.microbatch_overhead_us) == (900, 300)
    assert hw.attention_efficiency == hw.unfused_attention_efficiency == 1.0  # not measured
    path.write_text(json.dumps({"gemm_tflops": 0.4, "allreduce_gbps": 2.5, "memory_gib": 16,
                                "attention_tflops": 0.22}))
    hw = load_hardware("cpu", calibration=path)
    assert hw.attention_efficiency == hw.unfused_attention_efficiency == pytest.approx(0.55)
    assert PROFILES["a100-80gb"].layer_overhead_us == 0.0  # GPUs: launches run ahead


def test_profile_from_json_file(tmp_path):
    path = tmp_path / "my-gpu.json"
    path.write_text(json.dumps({**PROFILES["h100-80gb"].to_dict(), "name": "my-gpu",
                                "gemm_efficiency": 0.6}))
    hw = load_hardware(str(path))
    assert hw.name == "my-gpu" and hw.gemm_efficiency == 0.6
    path.write_text(json.dumps({"name": "x", "warp_speed": 9}))
    with pytest.raises(PlanError, match="unknown hardware fields"):
        load_hardware(str(path))
