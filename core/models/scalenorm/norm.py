"""`ScaleNorm`: `y = scale * sqrt(hidden) * x / ||x||`, one learned scalar per norm."""

from __future__ import annotations

import torch
from torch import nn

from tessera.core.config import ModelConfig


class ScaleNorm(nn.Module):
    """Scales each hidden vector to length `scale * sqrt(hidden)`; `scale` starts at 1 (the
    decoder's init of norm weights), which gives the unit root-mean-square RMSNorm starts from.
    The norm is computed in fp32, as RMSNorm's."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.eps, self.root = config.norm_eps, config.hidden_size ** 0.5
        self.scale = nn.Parameter(torch.empty(1))
        # Under SP each tp rank sees a different sequence chunk: gradients must be summed.
        self.scale.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        length = xf.norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (xf * (self.scale.float() * self.root / length)).to(x.dtype)
