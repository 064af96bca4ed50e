"""The CPU's ISA from its flags, and the serving defaults it implies (`core.cpu_isa`), as
`tessera serve` applies them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import tessera.core.cpu_isa as cpu_isa_module
from tessera.core import checkpoint
from tessera.core.cpu_isa import CpuIsa, cpu_isa, serving_defaults
from tessera.serving.cli import host_choices

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
EPYC_AVX2 = {"fma", "avx", "f16c", "avx2"}  # an AMD EPYC host with AVX2 and no AVX-512


def test_flags_name_the_isa_and_whether_bf16_is_native():
    assert cpu_isa(AMX).name == "AMX" and cpu_isa(AMX).native_bf16
    assert cpu_isa({"avx2", "avx512f", "avx512_bf16"}).name == "AVX-512 bf16"
    epyc = cpu_isa(EPYC_AVX2)
    assert epyc.name == "AVX2" and not epyc.native_bf16 and "emulated" in str(epyc)
    here = cpu_isa()  # this host, from /proc/cpuinfo: agrees with torch's own detection
    capability = torch.backends.cpu.get_cpu_capability()
    assert here.avx2 == (capability in ("AVX2", "AVX512")) or not capability.startswith("AVX")


def test_serving_defaults_follow_native_bf16():
    assert serving_defaults(cpu_isa(AMX), "fp32") == serving_defaults(cpu_isa(AMX), "bf16")
    assert (serving_defaults(cpu_isa(AMX), "fp32").dtype,
            serving_defaults(cpu_isa(AMX), "fp32").compile_decode) == ("bf16", True)
    avx2 = serving_defaults(cpu_isa(EPYC_AVX2), "bf16")
    assert (avx2.dtype, avx2.compile_decode) == ("fp32", False)
    assert serving_defaults(cpu_isa(EPYC_AVX2), "bf16", "cuda").dtype == "bf16"


def test_serve_runs_a_bf16_checkpoint_in_fp32_where_bf16_is_emulated(monkeypatch, capsys):
    # Only the manifest's dtype matters here (building a model would import dynamo: slow).
    monkeypatch.setattr(checkpoint, "read_manifest", lambda path: SimpleNamespace(dtype="bfloat16"))
    ckpt = "a-bf16-checkpoint"
    monkeypatch.setattr(cpu_isa_module, "_proc_flags", lambda: EPYC_AVX2)
    assert host_choices(ckpt, None, False, "cpu") == ("fp32", False)
    assert "serves it in fp32" in capsys.readouterr().err
    assert host_choices(ckpt, "bf16", "on", "cpu") == ("bf16", True)  # explicit choices stand
    assert host_choices(ckpt, "auto", "auto", "cpu") == ("fp32", False)
    monkeypatch.setattr(cpu_isa_module, "_proc_flags", lambda: AMX)
    assert host_choices(ckpt, None, False, "cpu") == (None, False)  # the checkpoint's bf16
    assert host_choices(ckpt, "auto", "auto", "cpu") == ("bf16", True)
    assert CpuIsa().name == "baseline"
