"""Token-level cross entropy for language modelling: on logits (`cross_entropy_loss`), or fused
with the LM head (`linear_cross_entropy`), which never holds the [tokens, vocab] fp32 logits:
chunks of tokens, each chunk's logits made, reduced to its log-sum-exp and loss, and turned into
its gradients right away (the gradient of the head's input and the head's weight gradient, kept
for the backward, which only scales them). The same three matmuls as the unfused head, no
recompute. Under tensor parallelism (a vocab-sharded head) the log-sum-exp and the target logit
are all-reduced over the TP group, as `loss_parallel` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fivefold.model.norms import upcast

IGNORE_INDEX = -100
# Logits per chunk: [chunk tokens, local vocab] in fp32 is 128 MiB at most (one token's row
# whatever the vocabulary).
CHUNK_LOGITS = 1 << 25


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross entropy of logits [B, T, V] against labels [B, T], computed in fp32.

    reduction="mean": mean over tokens whose label != -100 (NaN if there are none, as in torch);
    reduction="sum": their sum (for callers that divide by a global token count themselves).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def chunk_tokens(tokens: int, local_vocab: int) -> int:
    """Tokens per chunk of `linear_cross_entropy` (at most `CHUNK_LOGITS` logits, >= 1)."""
    return max(1, min(tokens, CHUNK_LOGITS // max(1, local_vocab)))


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _chunk(h, w, labels, start: int, group, scale, grads: bool):
    """One chunk: (loss sum, d (scale * loss sum) / d logits in the compute dtype, or None) of
    h [n, D] against the local vocabulary rows w [Vl, D] starting at global id `start`."""
    logits = upcast(h @ w.T)  # [n, Vl]
    top = _all_reduce(logits.amax(-1), dist.ReduceOp.MAX, group)  # [n]
    local = labels - start
    here = (local >= 0) & (local < w.shape[0])
    picked = logits.gather(1, local.clamp(0, w.shape[0] - 1)[:, None])[:, 0] * here
    logits -= top[:, None]  # shifted as torch's log-softmax shifts them
    sums = torch.stack([logits.exp().sum(-1), (picked - top) * here])
    sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_sum = sums[0].log()
    valid = labels != IGNORE_INDEX
    loss = ((log_sum - sums[1]) * valid).sum()
    if not grads:
        return loss, None
    d_logits = (logits - log_sum[:, None]).exp_()  # the softmax, in place of the logits
    target = local.clamp(0, w.shape[0] - 1)[:, None]
    d_logits.scatter_add_(1, target, -here[:, None].to(d_logits.dtype))
    d_logits *= valid[:, None] * scale
    return loss, d_logits.to(h.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """`scale` x the sum over tokens of cross entropy(h @ w.T, labels) on local tensors (see
    the module docstring); h [N, D], w [Vl, D] in the compute dtype, labels [N] global ids,
    `scale` a 0-d fp32 tensor. The gradients are scaled before the matmuls, as the unfused
    head's backward scales the logits' gradient, so that a backward from this loss (gradient
    1) multiplies them by 1 exactly."""

    @staticmethod
    def forward(ctx, h, w, labels, start: int, group, scale, chunk: int, grads: bool):
        total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
        d_h = torch.empty_like(h) if grads else None
        d_w = None  # one chunk: its product; several: summed in fp32 (fp64 for fp64)
        for begin in range(0, h.shape[0], chunk):
            rows = slice(begin, begin + chunk)
            loss, d_logits = _chunk(h[rows], w, labels[rows], start, group, scale, grads)
            total += loss
            if d_logits is None:
                continue
            torch.mm(d_logits, w, out=d_h[rows])
            part = d_logits.T @ h[rows]
            d_w = part if d_w is None else upcast(d_w).add_(part)
        ctx.save_for_backward(d_h, None if d_w is None else d_w.to(w.dtype))
        return total * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d_h, d_w = ctx.saved_tensors
        d_h, d_w = (d_h * grad).to(d_h.dtype), (d_w * grad).to(d_w.dtype)
        return d_h, d_w, None, None, None, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _local_head(hidden: Any, weight: Any) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
    """(hidden [.., D] replicated on this rank, local weight rows, their first vocabulary id, TP
    group or None). A vocab-sharded DTensor weight (`Shard(0)` on a 1-D mesh) gathers a
    sequence-sharded hidden and returns its input gradient as a partial sum over the group."""
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return hidden, weight, 0, None
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        hidden = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
        return hidden, weight.full_tensor(), 0, None
    rows_per_rank = -(-weight.shape[0] // mesh.size())  # torch's Shard: ceil-sized chunks
    offset = min(mesh.get_local_rank() * rows_per_rank, weight.shape[0])
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, [Replicate()])
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    local_hidden = hidden.to_local(grad_placements=[Partial()])
    return local_hidden, weight.to_local(), offset, mesh.get_group()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "mean",
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """`scale * cross_entropy_loss(hidden @ weight.T, labels, reduction)` without the logits:
    hidden [B, T, D], weight [V, D] (a vocab-sharded DTensor under TP), labels [B, T]; the
    head's matmuls in the autocast dtype where autocast is on (as the unfused head), the
    softmax in fp32. A plain fp32 0-d tensor, the same on every TP rank. `scale` (a constant:
    no gradient) weighs the gradients before the matmuls, as the unfused backward does."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    h, w, start, group = _local_head(hidden, weight)
    dtype = _compute_dtype(h)
    h2 = h.reshape(-1, h.shape[-1]).to(dtype)
    flat = labels.reshape(-1)
    w2 = w.to(dtype)
    loss_dtype = torch.promote_types(dtype, torch.float32)
    scale = torch.as_tensor(scale, dtype=loss_dtype, device=h2.device).detach()
    if reduction == "mean":  # NaN without labelled tokens, as torch's
        scale = scale / (flat != IGNORE_INDEX).sum()
    grads = torch.is_grad_enabled() and (h2.requires_grad or w2.requires_grad)
    chunk = chunk_tokens(h2.shape[0], w.shape[0])
    with torch.autocast(h.device.type, enabled=False):
        return _LinearCrossEntropy.apply(h2, w2, flat, start, group, scale, chunk, grads)


def head_loss(
    model: Any,
    output: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "mean",
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """`scale` x the loss of `model`'s output against labels [B, T]: hidden states through the
    model's head (`linear_cross_entropy`) where the model returns them
    (`Transformer.head_in_loss`), else `cross_entropy_loss` of the logits."""
    if getattr(model, "head_in_loss", False):
        return linear_cross_entropy(output, model.output.weight, labels, reduction, scale)
    return cross_entropy_loss(output, labels, reduction) * scale
