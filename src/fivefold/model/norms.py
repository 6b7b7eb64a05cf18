"""RMSNorm computed in fp32 whatever the activation dtype (as in the Llama reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension; x [..., D] -> [..., D].

    The normalisation runs in fp32 and the result is cast back to the input dtype, so bf16
    activations do not lose the small-variance tail.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return (normed * self.weight.float()).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
