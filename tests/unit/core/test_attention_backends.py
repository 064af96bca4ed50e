"""Attention over a KV cache runs without cuDNN's SDPA kernel (it plans per key length, and
decode meets a new one each step); training attention keeps torch's own choice."""

from __future__ import annotations

import torch

from tessera.core import ModelConfig, build_model
from tessera.core.generation import generate_ids
from tessera.core.models.decoder.model import Attention


def _record_cudnn_flag(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    core = Attention._core

    def recording(self, *args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return core(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "_core", recording)
    return seen


def test_decoding_leaves_cudnn_out_and_training_keeps_it(monkeypatch):
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default, which training keeps
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0).eval()
    seen = _record_cudnn_flag(monkeypatch)
    model(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[2, 3, 4, 5]]))
    training = list(seen)
    seen.clear()
    generate_ids(model, [1, 2, 3], 3)
    assert training and all(training)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each pass
