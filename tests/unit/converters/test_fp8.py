"""FP8 checkpoints and the FP8 runtime: exact resharding, correct dequantization, measured error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tessera.converters.reshard import reshard_checkpoint
from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from tessera.core.fp8 import (
    Fp8,
    convert_to_fp8_linear,
    dequantize,
    quantize,
    scaled_mm_linear,
    to_fp8_,
)
from tessera.core.parallel.layers import plain_linear
from tessera.core.parallel.sharding import (
    shard_scale,
    shard_tensor,
    unshard_scales,
    unshard_tensors,
)
from tessera.core.parallel.weight_format import Dense, quantizable

from .ckpt_factory import CONFIGS, make_checkpoint

FP8 = torch.float8_e4m3fn
GRANULARITY = {"tensor": False, "channel": True}


def raw_globals(path) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name -> (stored global tensor, global scale or None), without dequantizing."""
    reader = CheckpointReader(path)
    config, out = reader.manifest.model, {}
    for name, files in reader.manifest.weight_map.items():
        q = unshard_tensors(name, reader.raw_shards(name), config)
        scale = None
        if q.dtype == FP8:
            scale = unshard_scales(name, [reader._get(f, name + ".scale") for f in files], config)
        out[name] = (q, scale)
    return out


@pytest.fixture(scope="module")
def orig(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8") / "orig", CONFIGS["gqa"], seed=7)


def test_quantize_round_trip_and_edge_cases():
    w = torch.randn(64, 32)
    w[3] = 0.0  # an all-zero row must not divide by zero
    for per_channel, shape in [(False, ()), (True, (64, 1))]:
        q, scale = quantize(w, per_channel)
        assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == shape
        back = dequantize(q, scale)
        assert torch.isfinite(back).all() and torch.equal(back[3], w[3])
        assert (back - w).norm() / w.norm() < 0.05
    q, scale = quantize(torch.tensor([[1.0, -2.0]]), amax=torch.tensor(1.0))  # saturates, no inf
    assert q.float().tolist() == [[448.0, -448.0]]
    assert quantizable("layers.3.attention.wqkv.weight")
    assert quantizable("layers.0.feed_forward.w2.weight")
    assert not any(quantizable(n) for n in ["output.weight", "tok_embeddings.weight",
                                              "layers.0.attention.wqkv.bias", "layers.1.ffn_norm.weight"])


@pytest.mark.parametrize("granularity", GRANULARITY)
def test_fp8_checkpoint_layout_and_manifest(orig, tmp_path, granularity):
    dst = tmp_path / "fp8"
    reshard_checkpoint(orig, dst, tp=2, fp8=True, fp8_per_channel=GRANULARITY[granularity],
                       progress=False)
    man = read_manifest(dst)
    assert man.fp8 == {"format": "e4m3", "granularity": granularity} and man.dtype == "float32"
    assert not any(name.endswith(".scale") for name in man.weight_map)  # scales sit next to weights
    with safe_open(str(dst / "model-tp01-pp00.safetensors"), "pt") as fh:
        for name in fh.keys():
            t = fh.get_tensor(name)
            if name.endswith(".scale"):
                weight = fh.get_tensor(name.removesuffix(".scale"))
                assert t.dtype == torch.float32
                assert t.shape == ((weight.shape[0], 1) if granularity == "channel" else ())
            else:
                assert t.dtype == (FP8 if quantizable(name) else torch.float32), name
        if granularity == "channel":  # row-parallel wo: rows whole on every rank, so is the scale
            wo = fh.get_tensor("layers.0.attention.wo.weight.scale")
            assert wo.shape == (64, 1)
            with safe_open(str(dst / "model-tp00-pp00.safetensors"), "pt") as fh0:
                assert torch.equal(fh0.get_tensor("layers.0.attention.wo.weight.scale"), wo)


@pytest.mark.parametrize("granularity", GRANULARITY)
def test_fp8_reshards_bit_exactly_through_every_layout(orig, tmp_path, granularity):
    config = CONFIGS["gqa"]
    src = reshard_checkpoint(orig, tmp_path / "fp8", tp=1, fp8=True,
                             fp8_per_channel=GRANULARITY[granularity], progress=False).destination
    want_raw, want = raw_globals(src), {n: CheckpointReader(src).global_tensor(n) for n in
                                        CheckpointReader(src).names()}
    # Quantizing directly at another layout gives the same values: scales use the global amax.
    direct = reshard_checkpoint(orig, tmp_path / "direct", tp=4, pp=2, fp8=True,
                                fp8_per_channel=GRANULARITY[granularity], progress=False)
    for name, (q, s) in raw_globals(direct.destination).items():
        assert torch.equal(q, want_raw[name][0]), name
        assert s is None or torch.equal(s, want_raw[name][1]), name
    for i, (tp, pp, vs) in enumerate([(2, 2, 1), (4, 1, 1), (1, 1, 1), (2, 2, 2)]):
        dst = tmp_path / f"hop{i}"
        summary = reshard_checkpoint(src, dst, tp=tp, pp=pp, virtual_stages=vs, progress=False)
        assert summary.fp8 == {"format": "e4m3", "granularity": granularity}
        reader = CheckpointReader(dst)
        for name, (q, s) in raw_globals(dst).items():
            assert torch.equal(q, want_raw[name][0]), (dst.name, name)
            assert (s is None) == (want_raw[name][1] is None)
            if s is not None:
                assert torch.equal(s, want_raw[name][1]), (dst.name, name)
            assert torch.equal(reader.global_tensor(name), want[name]), name
            for t, file in enumerate(reader.manifest.weight_map[name]):  # each rank: its slice
                if s is not None:
                    assert torch.equal(reader._get(file, name), shard_tensor(name, q, config, t, tp))
                    assert torch.equal(reader._get(file, name + ".scale"),
                                       shard_scale(name, s, config, t, tp))
            # Dequantized shards for another tp size agree with slicing the dequantized global.
            assert torch.equal(reader.shard(name, 1, 2), shard_tensor(name, want[name], config, 1, 2))
        src = dst


def test_dequantized_loading_gives_identical_logits_under_any_layout(orig, tmp_path):
    fp8 = reshard_checkpoint(orig, tmp_path / "fp8", fp8=True, progress=False).destination
    other = reshard_checkpoint(fp8, tmp_path / "fp8-tp4", tp=4, pp=2, virtual_stages=2,
                               progress=False).destination
    ids = torch.randint(0, 1003, (2, 10))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(fp8)(ids), load_checkpoint(other)(ids))


def test_fp8_source_stays_fp8_and_casts_only_the_rest(orig, tmp_path):
    fp8 = reshard_checkpoint(orig, tmp_path / "fp8", fp8=True, progress=False).destination
    with pytest.raises(CheckpointError, match="already FP8 with tensor scales"):
        reshard_checkpoint(fp8, tmp_path / "chan", fp8_per_channel=True, progress=False)
    assert not (tmp_path / "chan").exists()
    bf16 = reshard_checkpoint(fp8, tmp_path / "bf16", tp=2, dtype="bf16", progress=False)
    assert bf16.dtype == "bfloat16" and bf16.fp8["granularity"] == "tensor"
    a, b = raw_globals(fp8), raw_globals(bf16.destination)
    for name, (q, s) in a.items():
        if s is None:
            assert torch.equal(b[name][0], q.to(torch.bfloat16)), name
        else:
            assert torch.equal(b[name][0], q) and torch.equal(b[name][1], s), name


def test_fp8_file_is_about_half_the_bf16_size(tmp_path):
    # Linear layers dominate (94% of the parameters), as in real models.
    config = ModelConfig(name="fp8-size", vocab_size=256, hidden_size=256, num_layers=4,
                         num_heads=4, num_kv_heads=2, ffn_hidden_size=1024)
    src = make_checkpoint(tmp_path / "bf16", config, dtype=torch.bfloat16)
    out = reshard_checkpoint(src, tmp_path / "fp8", fp8=True, progress=False)
    size = {p: sum(f.stat().st_size for f in p.glob("*.safetensors"))
            for p in (src, tmp_path / "fp8")}
    ratio = size[tmp_path / "fp8"] / size[src]
    print(f"\nFP8 / bf16 weight bytes: {ratio:.3f} ({size[tmp_path / 'fp8']} / {size[src]})")
    assert 0.4 <= ratio <= 0.65
    assert out.bytes_written == size[tmp_path / "fp8"]


def _progressions(n: int, T: int, vocab: int, seed: int) -> torch.Tensor:
    """Random but structured text: arithmetic progressions mod `vocab` (start and step vary)."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + step * torch.arange(T + 1)) % vocab


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small model trained briefly on progressions, saved in fp32."""
    config = ModelConfig(name="fp8-ppl", vocab_size=32, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, ffn_hidden_size=128, max_position_embeddings=64)
    model = build_model(config, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(40):
        x = _progressions(16, 16, config.vocab_size, seed=step)
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_checkpoint(tmp_path_factory.mktemp("trained") / "ckpt", model.eval())


def _perplexity(model, x: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(model(x[:, :-1], x[:, 1:]).item())


def test_fp8_accuracy_logits_and_perplexity(trained, tmp_path):
    held_out = _progressions(64, 16, 32, seed=10_000)
    base = load_checkpoint(trained)
    with torch.no_grad():
        ref = base(held_out[:, :-1])
    ppl = _perplexity(base, held_out)
    lines = [f"\nheld-out perplexity fp32 {ppl:.4f}"]
    for granularity, per_channel in GRANULARITY.items():
        fp8 = reshard_checkpoint(trained, tmp_path / granularity, fp8=True,
                                 fp8_per_channel=per_channel, progress=False).destination
        variants = {"dequantized": load_checkpoint(fp8),
                    "_scaled_mm": convert_to_fp8_linear(load_checkpoint(trained), per_channel,
                                                        use_scaled_mm=True)}
        for kind, model in variants.items():
            with torch.no_grad():
                err = ((model(held_out[:, :-1]) - ref).norm() / ref.norm()).item()
            delta = _perplexity(model, held_out) - ppl
            lines.append(f"FP8 {granularity:<7} {kind:<11} logits rel err {err:.4f}, "
                         f"perplexity delta {delta:+.4f} ({100 * delta / ppl:+.2f}%)")
            assert err < 0.1 and abs(delta) / ppl < 0.05, lines[-1]
    print("\n".join(lines))


@pytest.mark.parametrize("granularity", GRANULARITY)
def test_convert_to_fp8_linear_matches_the_fp8_checkpoint(orig, tmp_path, granularity):
    per_channel = GRANULARITY[granularity]
    fp8 = reshard_checkpoint(orig, tmp_path / "fp8", fp8=True, fp8_per_channel=per_channel,
                             progress=False).destination
    model = convert_to_fp8_linear(load_checkpoint(orig), per_channel)
    swapped = {n for n, m in model.named_modules() if isinstance(getattr(m, "format", None), Fp8)}
    assert swapped == {f"layers.{i}.{m}" for i in range(4) for m in
                       ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2")}
    assert isinstance(model.output.format, Dense)
    stored = raw_globals(fp8)
    for name in swapped:
        layer = model.get_submodule(name)
        assert torch.equal(layer.weight, stored[name + ".weight"][0])
        assert torch.equal(layer.scale, stored[name + ".weight"][1])
    ids = torch.randint(0, 1003, (2, 10))
    with torch.no_grad():  # the dequantizing path is exactly the dequantized checkpoint
        assert torch.equal(model(ids), load_checkpoint(fp8)(ids))
    # Quantizing a model loaded from the FP8 checkpoint recovers the stored FP8 values.
    again = convert_to_fp8_linear(load_checkpoint(fp8), per_channel)
    for name in swapped:
        layer = again.get_submodule(name)
        assert torch.equal(layer.weight, stored[name + ".weight"][0])
        torch.testing.assert_close(layer.scale, stored[name + ".weight"][1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("granularity", GRANULARITY)
def test_scaled_mm_on_cpu_matches_the_dequantized_product(granularity):
    per_channel = GRANULARITY[granularity]
    layer = torch.nn.Linear(96, 48, bias=True)
    x = torch.randn(3, 5, 96)
    fast = to_fp8_(plain_linear(layer), per_channel, use_scaled_mm=True)
    slow = plain_linear(layer)
    slow.set_format(Fp8(use_scaled_mm=False), fast.weight, fast.scale)
    want = F.linear(x, dequantize(fast.weight, fast.scale), layer.bias)
    assert torch.equal(slow(x), want)
    got = fast(x)
    err = ((got - want).norm() / want.norm()).item()
    print(f"\n_scaled_mm vs dequantized matmul ({granularity} scales): rel err {err:.4f}")
    assert got.shape == (3, 5, 48) and err < 0.08
    y = scaled_mm_linear(x.bfloat16(), fast.weight, fast.scale)
    assert y.dtype == torch.bfloat16 and ((y.float() - want + layer.bias).norm() / want.norm()) < 0.1
