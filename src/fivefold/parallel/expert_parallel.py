"""Expert parallelism: a MoE layer's experts sharded over the EP group, tokens moved by all-to-all.

Details: docs/internals.md (`fivefold.parallel.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fivefold.model.moe import (
    GroupedExperts,
    MoE,
    Routing,
    expert_counts,
    grouped_swiglu,
    inverse_permutation,
)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ShardedExperts(nn.Module):
    """This rank's E/ep experts of a `GroupedExperts`; parameters are DTensor Shard(0) over EP.

    forward(x [M, D] grouped by local expert, tokens_per_expert [E/ep]) -> [M, D].
    """

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh, grad_scale: float) -> None:
        super().__init__()
        num_experts = experts.w1.shape[0]
        assert num_experts % mesh.size() == 0, "ParallelPlan.problems: ep divides the experts"
        self.grad_scale = grad_scale
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            sharded = distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(sharded, requires_grad=full.requires_grad))

    def _local(self, weight: torch.Tensor) -> torch.Tensor:
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGrad.apply(local, self.grad_scale) if self.grad_scale != 1.0 else local

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._local(self.w1), self._local(self.w2), self._local(self.w3)
        return grouped_swiglu(x, w1, w2, w3, tokens_per_expert)


@dataclass
class _AllToAllHandle:
    slot_inverse: torch.Tensor  # [N*K] sorted copy holding each slot (token * K + k)
    local_inverse: torch.Tensor  # [M] expert-grouped row holding each received row
    send_splits: list[int]  # copies sent to each EP rank
    recv_splits: list[int]  # copies received from each EP rank
    gates: torch.Tensor  # [N, K]


class AllToAllDispatcher:
    """Dropless token dispatcher over the EP group (see the module docstring).

    Keeps the last routing (`last_routing`) so the global load-balancing loss can be formed after
    the layer's forward.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.last_routing: Routing | None = None

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, _AllToAllHandle]:
        """tokens [N, D] -> (copies for the local experts [M, D] grouped by local expert,
        tokens_per_expert [E/ep], handle)."""
        self.last_routing = routing
        top_k = routing.expert_indices.shape[1]
        local_experts = routing.num_experts // self.ep
        flat_experts = routing.expert_indices.flatten()  # [N*K], slot = token * K + k
        slot_order = torch.argsort(flat_experts, stable=True)
        sorted_copies = tokens[slot_order // top_k]  # [N*K, D], by global expert id
        counts = expert_counts(flat_experts, routing.num_experts)  # [E]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, local_experts)  # [source rank, local expert]
        send_splits, recv_splits = self.splits(counts, recv_counts, flat_experts.numel())
        received = funcol.all_to_all_single_autograd(
            sorted_copies, recv_splits, send_splits, self.group
        )
        # received rows are ordered (source rank, local expert); regroup by local expert
        expert_of_row = torch.arange(local_experts, device=tokens.device).repeat(self.ep)
        expert_of_row = expert_of_row.repeat_interleave(
            recv_counts.flatten(), output_size=sum(recv_splits)
        )
        local_order = torch.argsort(expert_of_row, stable=True)
        handle = _AllToAllHandle(
            inverse_permutation(slot_order),
            inverse_permutation(local_order),
            send_splits,
            recv_splits,
            routing.gates,
        )
        return received[local_order], recv_counts.sum(0), handle

    def splits(
        self, counts: torch.Tensor, recv_counts: torch.Tensor, copies: int
    ) -> tuple[list[int], list[int]]:
        """(copies sent to, copies received from) each EP rank, from this rank's counts per
        expert [E] and the received counts [ep, E/ep]; `copies` (N*K) is their sum. The one host
        read-back of the dispatch: all_to_all_single takes its splits as lists."""
        send = counts.view(self.ep, -1).sum(1)
        return tuple(torch.stack([send, recv_counts.sum(1)]).tolist())

    def combine(self, expert_out: torch.Tensor, handle: _AllToAllHandle) -> torch.Tensor:
        """expert_out [M, D] (grouped by local expert) -> [N, D], gate-weighted over K copies."""
        returned = funcol.all_to_all_single_autograd(
            expert_out[handle.local_inverse], handle.send_splits, handle.recv_splits, self.group
        )  # [N*K, D] in sorted-by-expert order
        num_tokens, top_k = handle.gates.shape
        slots = returned[handle.slot_inverse].view(num_tokens, top_k, -1)
        return (slots * handle.gates.unsqueeze(-1).to(slots.dtype)).sum(dim=1)


def global_load_balancing_loss(routing: Routing, group: dist.ProcessGroup) -> torch.Tensor:
    """E * sum_e f_e * P_e over the tokens of every rank of `group` (see module docstring).

    Value: the single-process loss on the union of the group's tokens. Gradient w.r.t. this
    rank's router probabilities: E * f_e / N_local, whose mean over the group is the
    single-process gradient E * f_e / N_group (equal token counts per rank).
    """
    num_experts = routing.num_experts
    probs = routing.probs  # [N, E] fp32
    chosen = routing.expert_indices.flatten()  # [N*K]
    f64 = {"dtype": torch.float64, "device": probs.device}  # every piece on the router's device
    ones = torch.ones(chosen.numel(), **f64)
    counts = torch.zeros(num_experts, **f64).index_add_(0, chosen, ones)  # [E], no host sync
    stats = torch.cat(  # [2E + 2]: counts, probability sums, tokens, assignments
        [
            counts,
            probs.detach().sum(0).to(torch.float64),
            torch.tensor([probs.shape[0], chosen.numel()], **f64),
        ]
    )
    dist.all_reduce(stats, group=group)
    global_counts, global_prob_sum, global_tokens, global_assignments = stats.split(
        [num_experts, num_experts, 1, 1]
    )
    fraction = (global_counts / global_assignments).to(probs.dtype)
    local_mean = probs.mean(0)
    global_mean = (global_prob_sum / global_tokens).to(probs.dtype)
    mean_prob = local_mean + (global_mean - local_mean).detach()
    return num_experts * torch.sum(fraction * mean_prob)


def _global_aux_loss_hook(group: dist.ProcessGroup):
    def hook(moe: MoE, args: Any, output: torch.Tensor) -> None:
        routing = moe.dispatcher.last_routing
        moe.dispatcher.last_routing = None
        aux_loss = moe.aux_loss_coef * global_load_balancing_loss(routing, group)
        if moe.collects_aux_loss:  # not in a recompute (`fivefold.model.moe.MoE`)
            moe.aux_loss = aux_loss

    return hook


def _as_mesh(ep_mesh: DeviceMesh | dist.ProcessGroup) -> DeviceMesh:
    if isinstance(ep_mesh, DeviceMesh):
        if ep_mesh.ndim != 1:
            raise ValueError(f"the EP mesh must be 1-D, got {ep_mesh.ndim} dimensions")
        return ep_mesh
    return DeviceMesh.from_group(ep_mesh, "cpu" if dist.get_backend(ep_mesh) == "gloo" else "cuda")


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh | dist.ProcessGroup,
    *,
    aux_group: dist.ProcessGroup | None = None,
    expert_grad_scale: float | None = None,
) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` and dispatch tokens by all-to-all.

    Works on a model (or pipeline chunk) on the meta device or materialised: parameters keep
    their names and global shapes (DTensor Shard(0) on the expert dimension), so call
    `init_weights` after it as usual, or before it (values are kept). `aux_group`: the ranks whose
    tokens the load-balancing loss counts (default: the EP group; pass the group of all ranks
    that see different tokens of the same step, e.g. dp x cp). `expert_grad_scale`: factor on the
    experts' gradients (default 1/ep; see the module docstring). Returns the model.
    """
    mesh = _as_mesh(ep_mesh)
    group = mesh.get_group()
    scale = 1.0 / mesh.size() if expert_grad_scale is None else expert_grad_scale
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        if not isinstance(moe.experts, ShardedExperts):
            moe.experts = ShardedExperts(moe.experts, mesh, scale)
        moe.dispatcher = AllToAllDispatcher(group)
        previous = getattr(moe, "_global_aux_hook", None)
        if previous is not None:  # applied twice: keep one hook
            previous.remove()
        moe._global_aux_hook = moe.register_forward_hook(_global_aux_loss_hook(aux_group or group))
    return model


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert weight sharded by `apply_expert_parallel`."""
    return [
        (f"{name}.{pname}", p)
        for name, module in model.named_modules()
        if isinstance(module, ShardedExperts)
        for pname, p in module.named_parameters(recurse=False)
    ]
