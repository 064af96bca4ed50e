"""Compiled training kernels against their eager formulas, and when each path is taken.

The eager formulas themselves are held to Hugging Face `transformers` by the model parity tests
(`tests/unit/converters/test_hf_parity.py`); here the compiled versions are held to them.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from tessera.core import fused


@pytest.fixture(autouse=True)
def _mode():
    fused.set_mode("auto")
    yield
    fused.set_mode(None)


def _run(fn, inputs, grad_out_seed=1):
    """Output and input gradients of `fn` for a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed))
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


CASES = {
    "rms_norm": lambda T, dt: ((torch.randn(T, 3, 64, dtype=dt), torch.randn(64, dtype=dt)),
                               lambda x, w: fused.rms_norm(x, w, 1e-5),
                               lambda x, w: fused.rms_norm.eager(x, w, 1e-5)),
    "swiglu": lambda T, dt: ((torch.randn(T, 3, 96, dtype=dt),), fused.swiglu,
                             fused.swiglu.eager),
    # partial rotary (Nemotron): 16 of 32 dims rotate, cos/sin broadcast over heads
    "rotary": lambda T, dt: ((torch.randn(3, 4, T, 32, dtype=dt),
                              torch.randn(3, 1, T, 16, dtype=dt), torch.randn(3, 1, T, 16, dtype=dt)),
                             fused.rotary, fused.rotary.eager),
    "cross_entropy": lambda T, dt: (
        (torch.randn(T * 3, 50, dtype=dt),
         torch.randint(0, 50, (T * 3,)).index_fill(0, torch.tensor([1]), -100)),  # one ignored
        lambda x, t: fused.cross_entropy(x, t, -100),
        lambda x, t: fused.cross_entropy.eager(x, t, -100)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_matches_eager_across_shape_changes(name, dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for T in (5, 8, 13):  # the second shape triggers the dynamic-shape recompile
        inputs, compiled, eager = CASES[name](T, dtype)
        out_c, grads_c = _run(compiled, inputs)
        out_e, grads_e = _run(eager, inputs)
        torch.testing.assert_close(out_c, out_e, **tol)
        assert len(grads_c) == len(grads_e) > 0
        for gc, ge in zip(grads_c, grads_e):
            assert gc.dtype == ge.dtype
            torch.testing.assert_close(gc, ge, **tol)


def _frames_compiled(fn) -> int:
    torch._dynamo.utils.counters.clear()
    fn()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_reuses_the_graph_compiled_for_the_same_input_dtypes(name):
    """A mixed-precision step (autocast on) compiles nothing new for inputs of dtypes already
    compiled, and computes what the eager formula computes under autocast."""
    torch._dynamo.reset()
    inputs, compiled, eager = CASES[name](8, torch.float32)
    assert _frames_compiled(lambda: _run(compiled, inputs)) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _frames_compiled(lambda: _run(compiled, inputs)) == 0
        out_c, grads_c = _run(compiled, inputs)
        out_e, grads_e = _run(eager, inputs)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)


def test_compiled_only_while_autograd_records():
    x = torch.randn(4, 2, 16, requires_grad=True)
    w = torch.randn(16)
    torch._dynamo.reset()
    assert _frames_compiled(lambda: fused.rms_norm(x, w, 1e-5)) == 1
    torch._dynamo.reset()
    with torch.no_grad():  # inference: eager
        assert _frames_compiled(lambda: fused.rms_norm(x, w, 1e-5)) == 0
    assert _frames_compiled(lambda: fused.rms_norm(x.detach(), w, 1e-5)) == 0
    fused.set_mode("off")
    assert _frames_compiled(lambda: fused.rms_norm(x, w, 1e-5)) == 0


def test_mode_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.setenv("TESSERA_FUSED_KERNELS", "off")
    fused.set_mode(None)
    assert fused.mode() == "off"
    monkeypatch.setenv("TESSERA_FUSED_KERNELS", "fast")
    fused.set_mode(None)
    with pytest.raises(ValueError, match="TESSERA_FUSED_KERNELS='fast'.*auto"):
        fused.mode()
    with pytest.raises(ValueError, match="not one of"):
        fused.set_mode("always")


@pytest.fixture
def broken_compiler():
    """Inductor's C++ compiler missing, and no cached kernels to hide it.

    Through inductor's own `config.patch`, not `monkeypatch.setattr`: torch config modules keep
    their values outside `__dict__`, so pytest >= 9.2 finds no old value to put back and undoes the
    patch with `delattr`, which hides the option for the rest of the process.
    """
    config = torch._inductor.config
    before = (config.cpp.cxx, config.fx_graph_cache)
    torch._dynamo.reset()
    with config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        yield
    torch._dynamo.reset()  # drop what was traced against the broken compiler
    assert (config.cpp.cxx, config.fx_graph_cache) == before, "inductor config not restored"


def test_auto_falls_back_to_eager_with_one_warning(broken_compiler, caplog):
    x = torch.randn(4, 2, 32, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="tessera.core.fused"):
        out = fused.swiglu(x)
        again = fused.rms_norm(x, torch.ones(32), 1e-5)  # no second attempt, no second warning
    torch.testing.assert_close(out, fused.swiglu.eager(x), rtol=0, atol=0)
    torch.testing.assert_close(again, fused.rms_norm.eager(x, torch.ones(32), 1e-5), rtol=0, atol=0)
    warnings = [r for r in caplog.records if "fused kernels disabled" in r.getMessage()]
    assert len(warnings) == 1 and "TESSERA_FUSED_KERNELS=off" in warnings[0].getMessage()


def test_on_raises_when_compilation_fails(broken_compiler):
    fused.set_mode("on")
    with pytest.raises(Exception):  # noqa: B017 - whatever inductor raises must reach the user
        fused.swiglu(torch.randn(4, 2, 32, requires_grad=True))
