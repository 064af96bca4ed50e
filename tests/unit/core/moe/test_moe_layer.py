"""The MoE layer against references written token by token, and its parts against each other.

- grouped GEMM (`torch._grouped_mm`) vs the per-expert loop: bit-identical forward and backward;
- `MoEFeedForward` vs a per-token loop over the chosen experts (softmax/sigmoid scores, with and
  without top-k normalization, with a gated shared expert), outputs and gradients;
- capacity dropping in GShard's priority order, against a sequential count;
- the load-balancing loss against Hugging Face's `load_balancing_loss_func`, the z-loss against
  its formula, and the router-loss gradient injected through the layer output;
- expert bias: it steers the choice, not the weights, and moves toward balance;
- router statistics are recorded once per forward, activation recomputation included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.config import ConfigError, ModelConfig, TrainSchedule
from tessera.core.init import build_model, init_global_tensor
from tessera.core.moe.experts import GroupedExperts, grouped_mm_supported
from tessera.core.moe.layer import MoEFeedForward
from tessera.core.moe.losses import load_balancing_loss, z_loss
from tessera.core.moe.router import drop_over_capacity
from tessera.core.moe.stats import router_step_end, track_router_stats
from tessera.core.parallel.groups import ParallelGroups


def _config(**overrides) -> ModelConfig:
    base = dict(hidden_size=32, num_heads=4, ffn_hidden_size=48, num_layers=2)
    return ModelConfig.from_name("mixtral-tiny", **{**base, **overrides})


def _layer(config: ModelConfig, seed: int = 0) -> MoEFeedForward:
    layer = MoEFeedForward(config, 0, ParallelGroups(), sp=False)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(init_global_tensor(f"layers.0.feed_forward.{name}", config, seed) * 5)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 48, "swiglu").to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    xs = torch.randn(40, 32, dtype=dtype)
    counts = torch.tensor([10, 0, 25, 5])  # one expert gets nothing
    assert grouped_mm_supported(xs, experts.w1, experts.w2)
    runs = {}
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        x = xs.clone().requires_grad_()
        y = experts(x, counts)
        y.sum().backward()  # an expanded gradient: the grouped path must take it
        runs[grouped] = (y, x.grad, experts.w1.grad.clone(), experts.w2.grad.clone())
        experts.zero_grad()
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


def test_grouped_gemm_needs_aligned_strides():
    w1, w2 = torch.empty(4, 2 * 6, 30), torch.empty(4, 30, 6)  # 30 fp32 = 120 bytes
    assert not grouped_mm_supported(torch.empty(8, 30), w1, w2)
    experts = GroupedExperts(4, 30, 6, "swiglu")
    assert not experts.grouped(torch.empty(8, 30))


def _reference(layer: MoEFeedForward, x: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Token by token: the chosen experts' MLPs weighted by the router, plus the shared expert."""
    out = []
    w1, w2 = layer.experts.w1, layer.experts.w2
    for t in range(x.shape[0]):
        logits = x[t] @ layer.router.weight.t()
        scores = logits.softmax(-1) if config.moe.router_score == "softmax" else logits.sigmoid()
        top = torch.topk(scores, config.moe.top_k).indices
        weights = scores[top] / (scores[top].sum() if config.moe.norm_topk else 1)
        y = torch.zeros_like(x[t])
        for e, w in zip(top.tolist(), weights):
            gate, up = (w1[e] @ x[t]).chunk(2)
            y = y + w * (w2[e] @ (F.silu(gate) * up))
        if layer.shared_expert is not None:
            gate, up = (layer.shared_expert.w1.weight @ x[t]).chunk(2)
            shared = layer.shared_expert.w2.weight @ (F.silu(gate) * up)
            y = y + torch.sigmoid(layer.shared_expert_gate.weight @ x[t]) * shared
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("overrides", [
    {},
    {"moe_router_score": "sigmoid", "moe_top_k": 3},
    {"family": "qwen2_moe", "moe_norm_topk": False, "moe_ffn_hidden_size": 16,
     "moe_shared_ffn_hidden_size": 24},
], ids=["softmax-norm", "sigmoid-top3", "shared-expert"])
def test_layer_equals_a_per_token_reference(overrides):
    config = _config(**overrides)
    layer = _layer(config).eval()
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.reshape(15, 32).clone().requires_grad_()
    got, want = layer(xa), _reference(layer, xb, config)
    torch.testing.assert_close(got.reshape(15, 32), want, rtol=1e-5, atol=1e-6)
    params = [p for p in layer.parameters()]
    g_got = torch.autograd.grad(got.square().sum(), [xa, *params])
    g_want = torch.autograd.grad(want.square().sum(), [xb, *params])
    torch.testing.assert_close(g_got[0].reshape(15, 32), g_want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(g_got[1:], g_want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_drops_in_gshard_priority_order():
    gen = torch.Generator().manual_seed(0)
    chosen = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])  # (9, 2)
    cap = 3
    kept = drop_over_capacity(chosen, 4, cap)
    want, load = chosen.clone(), [0] * 4
    for j in range(2):  # first choices of every token, then second choices
        for t in range(9):
            e = int(chosen[t, j])
            if load[e] < cap:
                load[e] += 1
            else:
                want[t, j] = -1
    assert torch.equal(kept, want) and (kept == -1).any()


def test_dropped_tokens_get_only_the_shared_expert():
    config = _config(moe_capacity_factor=0.25, family="qwen2_moe", moe_shared_ffn_hidden_size=24)
    layer = _layer(config).eval()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    routing = layer.router(x)
    all_dropped = (routing.expert_ids < 0).all(dim=1)
    assert all_dropped.any()
    shared = torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)
    torch.testing.assert_close(layer(x)[all_dropped], shared[all_dropped])


def test_aux_loss_equals_hugging_face():
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    chosen = torch.topk(logits.softmax(-1), 2).indices
    got = load_balancing_loss(logits.softmax(-1), chosen, 8)
    want = modeling.load_balancing_loss_func((logits,), 8, 2)
    assert torch.equal(got, want) or abs(got.item() - want.item()) <= 1e-7
    assert z_loss(logits).item() == pytest.approx(
        (torch.logsumexp(logits, -1) ** 2).mean().item(), rel=1e-6)


def test_router_losses_reach_the_router_gradient():
    """The layer's output carries coef * aux / n_moe_layers (+ z) into the router's gradient,
    scaled by `aux_loss_scale`."""
    config = _config(moe_aux_loss_coef=0.3, moe_z_loss_coef=0.2)
    layer = _layer(config).train()
    layer.aux_loss_scale = 0.5
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(4))
    out = layer(x)
    grad = torch.autograd.grad(out.sum(), layer.router.weight)[0]
    layer.eval()
    routing = layer.router(x)
    extra = (0.3 * load_balancing_loss(routing.scores, routing.chosen, config.moe.num_experts)
             + 0.2 * z_loss(routing.logits)) / 2  # two MoE layers in the model
    want = torch.autograd.grad(layer(x).sum() + 0.5 * extra, layer.router.weight)[0]
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(grad, torch.autograd.grad(layer(x).sum(), layer.router.weight)[0])


def test_expert_bias_steers_choice_not_weights_and_moves_toward_balance():
    config = _config(moe_expert_bias=True, num_layers=1)
    model = build_model(config, seed=0).train()
    router = model.layers["0"].feed_forward.router
    assert torch.equal(router.expert_bias, torch.zeros(4)) and not router.expert_bias.requires_grad
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(5))
    plain = router(x)
    with torch.no_grad():
        router.expert_bias[3] = 10.0
    biased = router(x)
    assert (biased.expert_ids == 3).any(dim=1).all()  # every token now picks expert 3
    scores = plain.scores.gather(1, biased.chosen)  # ...weighted by its unbiased score
    torch.testing.assert_close(biased.weights, scores / scores.sum(-1, keepdim=True))
    track_router_stats([model])
    model(torch.randint(0, 512, (2, 16)))
    metrics = router_step_end([model], model.groups, sequence_parallel=False)
    # Expert 3 took every token: its bias goes down by the rate, the others' up.
    rate = config.moe.expert_bias_rate
    assert router.expert_bias[3].item() == pytest.approx(10.0 - rate)
    assert metrics["moe_tokens_per_expert_max"] == 32


def test_statistics_are_recorded_once_per_forward_under_recomputation():
    config = _config(moe_capacity_factor=0.5)
    model = build_model(config, schedule=TrainSchedule(recompute="full"), seed=0).train()
    track_router_stats([model])
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(6))
    model(ids, labels=ids).backward()
    assert [len(m.feed_forward.records) for m in model.layers.values()] == [1, 1]
    metrics = router_step_end([model], model.groups, sequence_parallel=False)
    kept = metrics["moe_tokens_per_expert_min"]
    assert metrics["moe_dropped_tokens"] > 0 and kept <= 16  # capacity 0.5 * 32 * 2 / 4 = 8
    assert set(metrics) == {"moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min",
                            "moe_tokens_per_expert_max", "moe_tokens_per_expert_cv",
                            "moe_dropped_tokens"}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"moe_top_k": 5}, "moe_top_k 5 must be between 1 and num_experts 4"),
    ({"moe_router_score": "relu"}, "moe_router_score 'relu' is unknown"),
    ({"moe_layer_freq": 3}, "moe_layer_freq 3 must be between 1"),
    ({"moe_capacity_factor": 0.0}, "moe_capacity_factor must be > 0"),
])
def test_bad_moe_configs_name_the_numbers(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(**overrides)


def test_presets_and_dense_defaults():
    assert ModelConfig().moe.num_experts == 0
    for name in ("mixtral-tiny", "qwen-moe-tiny", "mixtral-8x7b", "qwen1.5-moe-a2.7b"):
        assert ModelConfig.from_name(name).moe.num_experts > 0
    from tessera.core.parallel.sharding import num_parameters

    # Mixtral 8x7B: 46.7B parameters (Mistral AI's figure).
    assert num_parameters(ModelConfig.from_name("mixtral-8x7b")) == pytest.approx(46.7e9, rel=2e-3)
