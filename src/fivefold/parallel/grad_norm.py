"""The global gradient norm over every shard, pipeline stage and rank, in one all-reduce.

Each rank adds up the squares of its local gradient elements, each weighted by the inverse of
how many ranks hold that same shard, and one float64 all-reduce over the world sums them. For a
DTensor gradient on mesh M, the shards are told apart by M's sharded dimensions, so a shard is
held by (world / pp) / prod(sizes of the sharded dims) ranks of its pipeline stage; a plain
tensor is held by every rank of its stage. This works for any mix of meshes (dense weights on
(dp, tp), experts on (edp, ep)) where torch's `get_total_norm` needs one mesh at a time, and
clipping then matches `torch.nn.utils.clip_grad_norm_` (coefficient max_norm / (norm + 1e-6),
capped at 1).
"""

from __future__ import annotations

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


def global_grad_norm(grads: list[torch.Tensor], pp_size: int = 1) -> torch.Tensor:
    """L2 norm of all gradients of the model (a float64 scalar, equal on every rank).

    `grads`: this rank's gradients (plain tensors or DTensors). Collective over the world.
    """
    holders_per_stage = dist.get_world_size() // pp_size
    device = grads[0].device if grads else torch.device("cpu")
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if isinstance(grad, DTensor):
            local = grad.to_local()
            weight = _shard_count(grad) / holders_per_stage
        else:
            local, weight = grad, 1.0 / holders_per_stage
        total += local.detach().double().pow(2).sum().to(device) * weight
    dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place by min(1, max_norm / (total_norm + 1e-6))."""
    coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
