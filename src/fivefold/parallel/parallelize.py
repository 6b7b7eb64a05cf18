"""Apply a `ParallelPlan` to a model chunk in the one fixed order:

    PP split -> FP8 linears -> TP/SP -> EP -> CP -> activation checkpointing -> torch.compile
    -> FSDP/DDP

(the pipeline split is done by the caller, `split_model_for_pipeline`, because it decides which
chunks exist). Each step only swaps parameters for DTensors or swaps sub-modules
(`attention.core`, `moe.dispatcher`, `moe.experts`), so parameter names never change and the
deterministic initialisation (`fivefold.model.init`) gives every layout the single-process
weights. Works on the meta device: materialise and initialise afterwards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fivefold.parallel.context_parallel import apply_context_parallel
from fivefold.parallel.data_parallel import apply_data_parallel
from fivefold.parallel.expert_parallel import apply_expert_parallel, global_load_balancing_loss
from fivefold.parallel.mesh import Meshes
from fivefold.parallel.runtime_core import apply_fp8, apply_recompute_and_compile
from fivefold.parallel.tensor_parallel import apply_tensor_parallel
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan


def expert_dp_mesh(meshes: Meshes, plan: ParallelPlan):
    """The mesh expert weights are data-parallel over (ranks holding the same experts)."""
    if meshes.expert is None:
        return None
    if plan.dp_replicate == 1:
        return meshes.expert["edp_shard"]
    if plan.zero == 3:
        return meshes.expert["edp_replicate", "edp_shard"]
    return meshes.expert["edp_replicate", "edp_shard"]._flatten("edp")


class RoutingRecorder:
    """A MoE's local token dispatcher that remembers the last routing decision."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_routing = None

    def dispatch(self, tokens, routing):
        self.last_routing = routing
        return self.inner.dispatch(tokens, routing)

    def combine(self, expert_out, handle):
        return self.inner.combine(expert_out, handle)


def apply_global_aux_loss(chunk: nn.Module, group) -> None:
    """Without expert parallelism, still take each MoE's load-balancing loss over the tokens of
    every rank in `group` (all ranks that see different tokens), as the single-process run does
    over the global micro-batch; expert parallelism does the same inside its dispatcher."""

    def hook(moe: nn.Module, args, output) -> None:
        routing, moe.dispatcher.last_routing = moe.dispatcher.last_routing, None
        aux_loss = moe.aux_loss_coef * global_load_balancing_loss(routing, group)
        if moe.collects_aux_loss:  # not in a recompute (`fivefold.model.moe.MoE`)
            moe.aux_loss = aux_loss

    for block in chunk.layers.values():
        moe = getattr(block, "moe", None)
        if moe is not None:
            moe.dispatcher = RoutingRecorder(moe.dispatcher)
            moe.register_forward_hook(hook)


def parallelize_chunk(
    chunk: nn.Module,
    spec: ModelSpec,
    plan: ParallelPlan,
    meshes: Meshes,
    device: torch.device,
    compile: bool = False,
) -> list[FSDPModule]:
    """TP/SP, EP, CP, recompute, torch.compile per block (`compile`) and FSDP/DDP on one chunk,
    in place; returns the DP modules."""
    apply_fp8(chunk, plan, device)
    if plan.tp > 1:
        apply_tensor_parallel(chunk, meshes["tp"], spec, plan.sp)
    routing = meshes.routing if meshes.routing is not None else meshes.dp_cp
    if plan.ep > 1:
        # The runtime sums gradients over data-parallel ranks and scales each rank's loss by
        # 1 / (global tokens), so the experts' gradients must not be rescaled; the router's
        # load-balancing loss counts the tokens of every rank that routes different tokens
        # (dp x cp, and the TP ranks: a MoE under TP splits its tokens over them).
        apply_expert_parallel(
            chunk, meshes["ep"], aux_group=routing.get_group(), expert_grad_scale=1.0
        )
    elif spec.is_moe and routing.size() > 1:
        apply_global_aux_loss(chunk, routing.get_group())
    if plan.cp > 1:
        apply_context_parallel(chunk, meshes["cp"], plan.cp_kind)
    apply_recompute_and_compile(chunk, plan, device, compile)
    return apply_data_parallel(chunk, meshes, plan, device, expert_dp_mesh(meshes, plan))
