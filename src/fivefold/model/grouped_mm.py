"""One grouped GEMM, `torch._grouped_mm`, with a backward of its own, for every dtype and under
fake tensors.

`grouped_mm(x [M, K], weight [E, K, N], offsets [E])` multiplies each group of rows of x (the
rows up to offsets[e], int32 cumulative counts) by its expert's weight -> [M, N], a fresh tensor
(not a view, so FSDP2 can hook it) whose backward takes any gradient layout (a broadcast one of
a `.sum()` too). Its gradients are two more grouped GEMMs: grad_x = grad @ weight^T per group,
grad_weight [E, K, N] = (grad^T @ x)^T per group of rows, the calls torch's own derivative
makes for these layouts (row-major x, a transposed [E, N, K] weight).

torch's shape function (meta kernel) of `_grouped_mm` accepts bf16 only, although its CPU and
CUDA kernels take fp32 too: other dtypes go through `fivefold::grouped_mm`, an operator that runs
the same kernel and whose shape function takes every dtype, so a dry run under fake tensors
takes the path the run takes.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fivefold::grouped_mm", mutates_args=())
def _any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_any_dtype.register_fake
def _any_dtype_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [E, K, N] -> [M, N]; a [N, M] @ b [M, K] grouped over M -> [E, N, K]."""
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _any_dtype(a, b, offs)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return _mm(x, weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # `_grouped_mm` refuses broadcast (stride 0) operands
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(grad, weight.transpose(-2, -1), offsets)
        if ctx.needs_input_grad[1]:
            # (grad^T x)^T: [E, N, K], the layout of the weights the experts store, transposed
            grad_w = _mm(grad.transpose(0, 1), x, offsets).transpose(-2, -1)
        return grad_x, grad_w, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] grouped by offsets [E] (int32 cumulative row counts), weight [E, K, N] -> [M, N]."""
    return _GroupedMM.apply(x, weight, offsets)
