"""RMSNorm computed in fp32 whatever the activation dtype (as in the Llama reference), keeping
for the backward only its input (in its own dtype) and the fp32 reciprocal RMS per token."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def _token_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(x.dim() - 1))


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or in its own dtype where that is wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    """y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps), in fp32
    (fp64 for fp64 x), y in x's dtype.

    Saves x, rstd [..., 1] and the weight; the backward recomputes x * rstd.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = upcast(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = upcast(x) * rstd
        g = upcast(grad)
        d_weight = (g * normed).sum(_token_dims(g))
        g_normed = g * weight.to(g.dtype)
        d_x = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
        return d_x.to(x.dtype), d_weight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalised over D in fp32, times `weight` [D], in x's dtype.

    A DTensor x is normalised on its local tokens. Over a mesh dim where x is sharded over
    tokens (sequence parallelism) the weight's gradient is a partial sum, reduced with the
    other gradients (FSDP2 reduces a partial gradient's non-data-parallel dims); where x is
    replicated (e.g. latent attention's replicated down projections) every rank's gradient is
    already the whole one."""
    if not isinstance(x, DTensor):
        return _RMSNorm.apply(x, weight, eps)
    if isinstance(weight, DTensor):
        weight = weight.to_local(grad_placements=_weight_grad_placements(x, weight))
    local = _RMSNorm.apply(x.to_local(), weight, eps)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)


def _weight_grad_placements(x: DTensor, weight: DTensor) -> list:
    if weight.device_mesh != x.device_mesh:
        return [Partial()] * weight.device_mesh.ndim
    return [Partial() if p.is_shard() else Replicate() for p in x.placements]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension; x [..., D] -> [..., D].

    The normalisation runs in fp32 and the result is cast back to the input dtype, so bf16
    activations do not lose the small-variance tail (`rms_norm`).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
