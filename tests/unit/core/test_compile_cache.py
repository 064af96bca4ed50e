"""Compiled kernels cached on disk under one CPU vector ISA are not reused under another.

Each run is a fresh process (the ISA is an environment variable) sharing one empty Inductor
cache directory; it compiles the fused RMSNorm for training and reports Inductor's cache
counters. Without the ISA in the cache key the `default` run is handed the vectorised run's
C++ source and fails to compile it (on an AVX-512 host, an `avx2` run handed AVX-512 source
computes half of each vector and trains on garbage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, torch
from torch._dynamo.utils import counters
from tessera.core import fused
torch.set_num_threads(1)
torch.manual_seed(0)
fused.set_mode("on")
x = torch.randn(4, 8, 64, requires_grad=True)
w = torch.ones(64, requires_grad=True)
fused.rms_norm(x, w, 1e-5).sum().backward()
ref = torch.func.grad(lambda x: fused.rms_norm.eager(x, w, 1e-5).sum())(x)
# Kernel and eager sum the row's 64 squares and 64 gradient terms in different orders: each
# differs by at most 64 fp32 roundings of the largest term (measured: 2e-7 to 6e-7). A kernel
# built for another ISA that leaves lanes unwritten is off by O(1).
ok = bool((x.grad - ref).abs().max() <= 64 * torch.finfo(torch.float32).eps * ref.abs().max())
print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"], "grad_ok": ok}))
"""


def _vectorised_capability() -> str:
    """The ATEN_CPU_CAPABILITY naming this host's widest ISA Inductor vectorises for."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    for isa in valid_vec_isa_list():
        if str(isa) in ("avx512", "avx2", "zvector", "vsx"):
            return str(isa)
    pytest.skip("Inductor vectorises for no ISA that ATEN_CPU_CAPABILITY can name on this host")


def _compile(capability: str, cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_CACHE_KEY_TAG"}
    env.update(ATEN_CPU_CAPABILITY=capability, TORCHINDUCTOR_CACHE_DIR=cache_dir,
               TESSERA_FUSED_KERNELS="on", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # two cold Inductor compiles (40 s here): `make test-slow` runs it
def test_each_cpu_isa_compiles_its_own_kernels(tmp_path):
    vectorised = _vectorised_capability()
    cache = str(tmp_path / "inductor")
    first = _compile(vectorised, cache)
    assert first["misses"] > 0 and first["hits"] == 0 and first["grad_ok"], first
    scalar = _compile("default", cache)
    assert scalar["hits"] == 0 and scalar["misses"] > 0 and scalar["grad_ok"], scalar
    again = _compile(vectorised, cache)  # the cache still serves the ISA that wrote it
    assert again["hits"] > 0 and again["misses"] == 0 and again["grad_ok"], again


def test_the_cache_directory_is_the_one_given(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from tessera.core.compile_cache import use_compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    chosen = use_compile_cache_dir(tmp_path / "inductor")
    assert chosen.is_dir() and cache_dir() == str(tmp_path / "inductor")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="give a writable directory"):
        use_compile_cache_dir(tmp_path / "file" / "sub")
