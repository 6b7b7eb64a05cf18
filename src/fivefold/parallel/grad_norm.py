"""The global gradient norm over every shard, pipeline stage and rank, in one all-reduce.

Details: docs/internals.md (`fivefold.parallel.grad_norm`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _shard_count(grad: DTensor) -> int:
    count = 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            count *= grad.device_mesh.size(dim)
        elif placement.is_partial():
            raise AssertionError("a gradient is still a partial sum; reduce it before the norm")
    return count


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _groups(grads: list[torch.Tensor], holders_per_stage: int) -> dict[tuple, list[torch.Tensor]]:
    """Local gradient tensors by (weight = 1 / ranks holding the shard, device, dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        count = _shard_count(grad) if isinstance(grad, DTensor) else 1
        local = _local(grad).detach()
        if local.numel():
            groups[(count / holders_per_stage, local.device, local.dtype)].append(local)
    return groups


def global_grad_norm(grads: list[torch.Tensor], pp_size: int = 1) -> torch.Tensor:
    """L2 norm of all gradients of the model (a float64 scalar, equal on every rank).

    `grads`: this rank's gradients (plain tensors or DTensors). Collective over the world.
    """
    holders_per_stage = dist.get_world_size() // pp_size
    device = grads[0].device if grads else torch.device("cpu")
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (weight, _, _), tensors in _groups(grads, holders_per_stage).items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        squares = torch.stack(norms).double().pow(2).sum()
        total += squares.to(device) * weight
    dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place by min(1, max_norm / (total_norm + 1e-6)), without a host sync."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        local = _local(grad)
        by_kind[(local.device, local.dtype)].append(local)
    for (device, dtype), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(device, dtype))
