"""What this CPU computes natively, and the serving defaults that follow from it.

Whether bf16 is fast on a CPU decides the right serving setup: with AMX (Sapphire Rapids and
later) or AVX-512 bf16, oneDNN multiplies bf16 natively and a compiled bf16 decode step is the
fastest; on AVX2 alone (e.g. AMD EPYC before Zen 4, most laptops) every bf16 product is
converted to fp32 around the arithmetic, so bf16 is slower than fp32, not faster. Figures
measured on one host say nothing about another unless the ISA is printed beside them.

- `cpu_isa()` reads the flags (`/proc/cpuinfo` on Linux, else torch's own detection).
- `serving_defaults(isa, checkpoint_dtype)` chooses the compute dtype and whether to compile
  the decode step; `tessera serve` applies it to whatever the user left unset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuIsa:
    """The vector extensions that matter for CPU inference."""

    amx_bf16: bool = False
    avx512_bf16: bool = False
    avx512: bool = False
    avx2: bool = False

    @property
    def native_bf16(self) -> bool:
        """bf16 products run natively (no conversion to fp32 around each one)."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def name(self) -> str:
        """The best of them: "AMX", "AVX-512 bf16", "AVX-512", "AVX2" or "baseline"."""
        for flag, name in ((self.amx_bf16, "AMX"), (self.avx512_bf16, "AVX-512 bf16"),
                           (self.avx512, "AVX-512"), (self.avx2, "AVX2")):
            if flag:
                return name
        return "baseline"

    def __str__(self) -> str:
        if self.native_bf16:
            return f"{self.name} (native bf16)"
        return f"{self.name} (no AMX, no AVX-512 bf16: bf16 is emulated)"


def cpu_isa(flags: set[str] | None = None) -> CpuIsa:
    """This CPU's `CpuIsa`, from `flags` (as `/proc/cpuinfo` spells them) when given."""
    if flags is None:
        flags = _proc_flags()
    if flags is None:  # not Linux: torch's detection (it does not tell avx512_bf16 apart)
        import torch

        capability = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX2", "AVX512", "ZVECTOR"
        return CpuIsa(amx_bf16="AMX" in capability, avx512="AVX512" in capability,
                      avx2="AVX2" in capability or "AVX512" in capability)
    return CpuIsa(amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags,
                  avx512="avx512f" in flags, avx2="avx2" in flags)


def _proc_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


@dataclass(frozen=True)
class ServingDefaults:
    dtype: str  # "fp32" | "bf16" | "fp16"
    compile_decode: bool
    reason: str  # one line for the start-up log


def serving_defaults(isa: CpuIsa, checkpoint_dtype: str, device: str = "cpu") -> ServingDefaults:
    """The compute dtype and compile setting for serving a `checkpoint_dtype` checkpoint.

    On CUDA: the checkpoint's dtype, eager. On a CPU with native bf16: bf16 and a compiled
    decode step (the fastest there: README's table). Without it: fp32 (a bf16 or fp16
    checkpoint is upcast; bf16 emulation is slower than fp32) and eager (compiling the
    multi-row decode graph is slower than eager there; see `bench/bench_generate.py`).
    """
    if device != "cpu":
        return ServingDefaults(checkpoint_dtype, False, f"{device}: the checkpoint's dtype")
    if isa.native_bf16:
        return ServingDefaults("bf16", True, f"CPU {isa}: bf16 with a compiled decode step")
    return ServingDefaults("fp32", False, f"CPU {isa}: fp32, eager")
