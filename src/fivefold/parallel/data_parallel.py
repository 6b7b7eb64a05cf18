"""Data parallelism: DDP, ZeRO-1/2/3 and HSDP, all on FSDP2 (`fully_shard` / `replicate`).

Details: docs/internals.md (`fivefold.parallel.data_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fivefold.parallel.mixed_precision import resolve_precision
from fivefold.parallel.offload import cpu_offload_policy
from fivefold.specs.plan import ParallelPlan


def compute_dtype(plan: ParallelPlan, device: torch.device) -> torch.dtype:
    """The dtype forward/backward run in (the one resolution: `resolve_precision`)."""
    return resolve_precision(plan.precision, device).dtype


def mixed_precision_policy(
    plan: ParallelPlan, device: torch.device, cast_inputs: bool = True
) -> MixedPrecisionPolicy:
    """FSDP2's policy for `plan`: bf16 parameters and fp32 gradient reduction under bf16
    compute. `cast_inputs=False` (the blocks) leaves the module's inputs as they come: the
    hidden states are already bf16 (the root casts its own), and the RoPE tables stay fp32
    and, with the document layout, one object per forward, as in one process."""
    dtype = compute_dtype(plan, device)
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs
    )


def dp_mesh_for(meshes, plan: ParallelPlan) -> DeviceMesh:
    """The mesh dense weights are replicated/sharded over (see the module docstring)."""
    if plan.zero == 0:
        return meshes.dp_cp
    if meshes.hsdp is not None:
        return meshes.hsdp
    return meshes.dp_shard_cp


def _wrap(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: ParallelPlan,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    device: torch.device,
    shard_placement_fn=None,
) -> None:
    if plan.zero == 0:
        replicate(module, mesh=mesh, mp_policy=mp)
        return
    extra = {}
    if plan.offload == "all":
        extra["offload_policy"] = cpu_offload_policy(device)
    if shard_placement_fn is not None:
        extra["shard_placement_fn"] = shard_placement_fn
    fully_shard(
        module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **extra
    )


def expert_shard_placement(experts: nn.Module, mesh: DeviceMesh):
    """FSDP shards dim 0 by default, the expert dimension; after EP a rank may hold fewer
    experts than the sharding mesh has ranks (one rank then keeps whole experts, the others
    nothing), so shard the weights' second dimension [E_local, F|D, D|F] instead (as
    torchtitan does); None keeps the default."""
    local = min(
        (p.to_local() if isinstance(p, DTensor) else p).shape[0] for p in experts.parameters()
    )
    if local % mesh.size(-1) == 0:
        return None
    return lambda param: Shard(1)


def apply_data_parallel(
    model: nn.Module,
    meshes,
    plan: ParallelPlan,
    device: torch.device,
    expert_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Wrap each block, then the root, of `model` (a Transformer or pipeline chunk) in place.

    With expert parallelism (`expert_mesh` = the expert data-parallel mesh), each MoE's
    `experts` are wrapped separately over that mesh, since they are not replicated over the ep
    ranks. Returns every wrapped module (for gradient-sync control), root last.
    """
    mesh = dp_mesh_for(meshes, plan)
    mp, block_mp = mixed_precision_policy(plan, device), mixed_precision_policy(plan, device, False)
    reshard = plan.zero == 3
    wrapped: list[FSDPModule] = []
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if expert_mesh is not None and moe is not None:
            placement = expert_shard_placement(moe.experts, expert_mesh)
            _wrap(moe.experts, expert_mesh, plan, mp, reshard, device, placement)
            wrapped.append(moe.experts)
        _wrap(block, mesh, plan, block_mp, reshard, device)
        wrapped.append(block)
    # The root keeps its (small) parameters gathered after forward: the head runs first in
    # backward, so re-sharding them would only add an all-gather.
    _wrap(model, mesh, plan, mp, False, device)
    wrapped.append(model)
    for module in wrapped:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return wrapped


def set_gradient_sync(
    modules: list[FSDPModule], plan: ParallelPlan, last_micro_batch: bool
) -> None:
    """Before a micro-batch's backward: reduce now, or keep accumulating locally.

    ZeRO-2 and ZeRO-3 reduce-scatter every micro-batch (sharded gradients between
    micro-batches); ZeRO-0/1 communicate gradients only after the last micro-batch. ZeRO-1/2
    keep the gathered parameters until the last backward of the step.
    """
    sync = last_micro_batch or plan.zero >= 2
    for module in modules:
        module.set_requires_gradient_sync(sync, recurse=False)
        if plan.zero in (1, 2):
            module.set_reshard_after_backward(last_micro_batch, recurse=False)
