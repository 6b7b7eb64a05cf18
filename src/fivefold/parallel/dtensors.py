"""Two DTensor helpers the optimizer-state code shares: a tensor's local shard, and a local
tensor wrapped back into a DTensor laid out like another."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """`local` as a DTensor with `like`'s mesh, placements and global shape, left where it is.

    Built from a spec, as FSDP2 builds its offloaded shards: `DTensor.from_local` would move a
    host tensor to the mesh's device (CUDA) and lose its pinned memory."""
    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    spec = DTensorSpec(like.device_mesh, like.placements, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)
