"""The dense MLP: SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x))), no biases, and
`silu_mul`, SwiGLU's element-wise part, which keeps only its two inputs for the backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up; saves gate and up only and recomputes silu(gate) in the backward
    (eager autograd would also keep silu(gate)). The backward runs the operators autograd runs
    for `F.silu(gate) * up`, so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return d_gate, grad * F.silu(gate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., F] -> [..., F]; autograd keeps gate and up only."""
    return _SiluMul.apply(gate, up)


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
        return self.w2(silu_mul(self.w1(x), self.w3(x)))
