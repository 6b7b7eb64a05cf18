"""The dense MLP: SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x))), no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """x [..., dim] -> [..., dim] through `hidden` units.

    `w1` and `w3` map dim -> hidden (TP: column-parallel), `w2` maps hidden -> dim (row-parallel).
    With mlp="gelu" there is no `w3` (the attribute is None).
    """

    def __init__(self, dim: int, hidden: int, mlp: str = "swiglu") -> None:
        super().__init__()
        if mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be 'swiglu' or 'gelu', got {mlp!r}")
        self.mlp = mlp
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
