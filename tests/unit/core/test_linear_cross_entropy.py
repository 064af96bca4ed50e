"""The chunked linear cross-entropy against the full-logits formula, in the decoder head, and in
memory.

Tolerances. fp32: the chunked loss is a sum of per-chunk sums and `W`'s gradient a sum of
per-chunk products, where the reference makes one reduction of each: float reassociation, a few
fp32 ulps of the result (rtol 1e-5). bf16: the logits and the gradient products are rounded to
bf16 (unit roundoff 2^-8) on both sides, but `W`'s gradient is rounded per chunk before the
chunks are summed, and the chunks' partial products cancel, so its error is a bf16 rounding of
the largest partial, not of each entry: atol 2^-6 * max|grad W| (measured: 2^-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.core import ModelConfig, build_model
from tessera.core import linear_cross_entropy as chunked_ce
from tessera.core.linear_cross_entropy import chunk_rows, linear_cross_entropy
from tessera.core.tensor_memory import PeakTensorBytes

N, C, V = 37, 48, 80
IGNORED = slice(8, 24)  # whole chunks of 8 rows and part of others hold no target


@pytest.fixture(autouse=True)
def _mode():
    yield
    chunked_ce.set_mode(None)


def _inputs(dtype=torch.float32, n=N, c=C, v=V):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, c, generator=g).to(dtype)
    w = (torch.randn(v, c, generator=g) / c**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[IGNORED] = -100
    return h, w, t


def _run(loss_fn, h, w, t, autocast=False):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _reference(reduction):
    return lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100,
                                           reduction=reduction)


def _chunked(reduction, rows):
    return lambda h, w, t: linear_cross_entropy(h, w, t, reduction=reduction, rows=rows)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", [1, 8, 10, N, 1000])  # 10: N is not a multiple
def test_fp32_matches_full_logits(reduction, rows):
    h, w, t = _inputs()
    ref = _run(_reference(reduction), h, w, t)
    out = _run(_chunked(reduction, rows), h, w, t)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "bf16"])
@pytest.mark.parametrize("rows", [8, 10])
def test_bf16_matches_full_logits(autocast, rows):
    h, w, t = _inputs(torch.float32 if autocast else torch.bfloat16, c=256, v=300)
    ref = _run(_reference("mean"), h, w, t, autocast)
    loss, grad_h, grad_w = _run(_chunked("mean", rows), h, w, t, autocast)
    assert grad_h.dtype == grad_w.dtype == h.dtype  # fp32 master weights keep fp32 gradients
    torch.testing.assert_close(loss, ref[0], rtol=2**-8, atol=0)
    torch.testing.assert_close(grad_h, ref[1], rtol=2**-7, atol=2**-7 * ref[1].abs().max())
    torch.testing.assert_close(grad_w, ref[2], rtol=0, atol=2**-6 * ref[2].abs().max())


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    h, w, t = _inputs()
    t[:] = -100
    loss, grad_h, grad_w = _run(_chunked("mean", 8), h, w, t)
    assert loss.item() == 0.0  # F.cross_entropy's mean is NaN here; the decoder's loss is 0
    assert not grad_h.any() and not grad_w.any()


def test_upstream_gradient_scales_the_gradients():
    h, w, t = _inputs()
    ref = _run(lambda *a: _reference("sum")(*a) * 0.25, h, w, t)
    out = _run(lambda *a: _chunked("sum", 8)(*a) * 0.25, h, w, t)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_grad_computes_the_loss_only():
    h, w, t = _inputs()
    h.requires_grad_(), w.requires_grad_()
    with torch.no_grad(), PeakTensorBytes() as memory:
        loss = linear_cross_entropy(h, w, t, rows=8)
    torch.testing.assert_close(loss, _reference("mean")(h, w, t), rtol=1e-5, atol=1e-6)
    assert memory.peak < w.numel() * 4  # no weight-sized gradient was made


def test_second_backward_is_refused():
    h, w, t = _inputs()
    loss = linear_cross_entropy(h.requires_grad_(), w, t, rows=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_bad_input_is_named():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="h .* weight"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match="weight \\(V, C\\)"):
        linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="one of"):
        chunked_ce.set_mode("sometimes")


def test_chunk_rows_bounds_a_chunks_fp32_logits():
    assert chunk_rows(128_256) == 523  # 523 * 128,256 * 4 bytes <= 256 MiB < 524 * ...
    assert chunk_rows(10**12) == 1


def test_reads_no_value_on_the_host():
    class Syncs(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Syncs.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    h, w, t = _inputs()
    with Syncs():
        _run(_chunked("mean", 8), h, w, t)
    assert Syncs.count == 0


def test_peak_memory_is_a_chunk_not_the_logits():
    n, c, v, rows = 2048, 32, 4096, 32
    h, w, t = _inputs(n=n, c=c, v=v)
    peaks = {}
    for name, fn in {"full": _reference("mean"), "chunked": _chunked("mean", rows)}.items():
        with PeakTensorBytes() as memory:
            _run(fn, h, w, t)
        peaks[name] = memory.peak
    logits, chunk, inputs = n * v * 4, rows * v * 4, (n + v) * c * 4
    assert peaks["full"] >= 2 * logits  # the logits, their log-softmax, its gradient
    # Copies of h and W and their gradients, and a few chunks' logits at a time.
    assert peaks["chunked"] <= 2 * inputs + 4 * chunk < logits / 8


def test_peak_tensor_bytes_counts_live_storages():
    with PeakTensorBytes() as memory:
        a = torch.ones(1000)
        a.add_(1)  # in place: no new storage
        view = a[:10]
        del a, view
        b = torch.ones(10)
    assert memory.peak == 4000 and memory.live == 40
    del b


def _model_grads(mode, tied, autocast):
    chunked_ce.set_mode(mode)
    config = ModelConfig.from_name("llama-tiny", tied_embeddings=tied)
    model = build_model(config, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :10] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_decoder_loss_and_grads_match_the_full_logits_head(tied, autocast, monkeypatch):
    calls = []
    real = chunked_ce.linear_cross_entropy
    monkeypatch.setattr(chunked_ce, "linear_cross_entropy",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    off_loss, off_grads = _model_grads("off", tied, autocast)
    assert not calls
    on_loss, on_grads = _model_grads("on", tied, autocast)
    assert calls  # the chunked head ran
    assert ("output.weight" in on_grads) is not tied  # the tied head's gradient is the table's
    rtol = 1e-5 if not autocast else 2**-8
    torch.testing.assert_close(on_loss, off_loss, rtol=rtol, atol=0)
    for name, grad in off_grads.items():
        atol = (1e-6 if not autocast else 2**-6) * grad.abs().max()
        torch.testing.assert_close(on_grads[name], grad, rtol=rtol, atol=atol, msg=name)


def test_auto_keeps_the_full_logits_head_on_cpu(monkeypatch):
    monkeypatch.setattr(chunked_ce, "linear_cross_entropy", None)  # would fail if called
    chunked_ce.set_mode("auto")
    h = torch.zeros(8192, 2)
    assert not chunked_ce.wanted(h, 128_256)
    _model_grads("auto", True, False)
