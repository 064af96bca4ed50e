"""RoPE angles stay fp32-exact when the model runs in bf16 (no coarsened frequency buffer)."""

import torch

from tessera.core import ModelConfig, build_model


def test_bf16_model_uses_fp32_angles():
    config = ModelConfig.from_name("llama-tiny", max_position_embeddings=8192)
    model = build_model(config, dtype=torch.bfloat16)
    positions = torch.tensor([[4095, 8191]])
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    dim = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).double() / dim))
    angles = positions.double().unsqueeze(-1) * inv
    expected = torch.cat([angles, angles], -1).cos().float().unsqueeze(1)
    torch.testing.assert_close(cos, expected, atol=2e-3, rtol=0)
    assert not list(model.buffers())
