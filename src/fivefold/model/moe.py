"""Mixture-of-experts feed-forward: a top-k router (`fivefold.model.routers`), grouped SwiGLU
experts, dropless.

Details: docs/internals.md (`fivefold.model.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fivefold.model.feed_forward import FeedForward, silu_mul
from fivefold.model.grouped_mm import grouped_mm
from fivefold.model.routers import RouterSettings, Routing, make_routing
from fivefold.model.routers import route as route  # re-exported


def expert_counts(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [num_experts] (int64) of any-shaped expert ids; a fixed-size
    result (unlike `bincount`, whose size depends on the ids), so shapes never wait for data."""
    flat = expert_indices.flatten()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """E * sum_e f_e * P_e (Switch Transformer, generalised to top-k); 1.0 when perfectly balanced.

    f_e: fraction of the N*K token-to-expert assignments that went to expert e (no gradient);
    P_e: mean router probability of expert e over the N tokens (carries the gradient).
    """
    num_experts = routing.num_experts
    counts = expert_counts(routing.expert_indices, num_experts)
    fraction = counts.to(routing.probs.dtype) / routing.expert_indices.numel()
    mean_prob = routing.probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


class TokenDispatcher(Protocol):
    """Moves token copies to their experts and back. `handle` is opaque to the caller."""

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """tokens [N, D] -> (grouped [M, D] sorted by local expert, tokens_per_expert [E_local],
        handle)."""
        ...

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """expert_out [M, D] (same order as grouped) -> [N, D], gate-weighted sum per token."""
        ...


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """[M] int64 `inverse` with `inverse[order[j]] = j`: `x[inverse]` puts the rows of `x` back
    where `order` took them from. Autograd saves only the index of such a gather, where an
    out-of-place `index_copy` would save its whole source."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


@dataclass
class _LocalHandle:
    inverse: torch.Tensor  # [N*K] grouped row holding slot (token * K + k)
    gates: torch.Tensor  # [N, K]


class LocalDispatcher:
    """All experts on this rank: a stable sort of the N*K token copies by expert id."""

    def dispatch(
        self, tokens: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, _LocalHandle]:
        top_k = routing.expert_indices.shape[1]
        flat_experts = routing.expert_indices.flatten()  # [N*K], slot = token * K + k
        order = torch.argsort(flat_experts, stable=True)
        grouped = tokens[order // top_k]  # [N*K, D]
        tokens_per_expert = expert_counts(flat_experts, routing.num_experts)
        return grouped, tokens_per_expert, _LocalHandle(inverse_permutation(order), routing.gates)

    def combine(self, expert_out: torch.Tensor, handle: _LocalHandle) -> torch.Tensor:
        num_tokens, top_k = handle.gates.shape
        slots = expert_out[handle.inverse].view(num_tokens, top_k, -1)  # back to slot order
        weighted = slots * handle.gates.unsqueeze(-1).to(slots.dtype)
        return weighted.sum(dim=1)


def _grouped_mm_fits(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """`_grouped_mm` needs 16-byte aligned row strides (D and F elements of the dtype); under
    torch.compile its shape function in 2.13 also accepts bf16 only."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    itemsize = x.element_size()
    return (x.shape[-1] * itemsize) % 16 == 0 and (w1.shape[1] * itemsize) % 16 == 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (`_grouped_mm` is not on its cast lists)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """E SwiGLU experts over contiguous groups: x [M, D] sorted by expert, w1, w3 [E, F, D],
    w2 [E, D, F], tokens_per_expert [E] (sum M) -> [M, D].

    One grouped GEMM per projection (`fivefold.model.grouped_mm`, in every dtype, under fake
    tensors too); the group boundaries stay on the device (cumulative counts as int32 offsets),
    so nothing waits for the router. Shapes whose rows `_grouped_mm`
    cannot address (not 16-byte aligned), and fp32 under torch.compile, fall back to a loop over
    experts (one host sync; a graph break when compiled).
    """
    if tokens_per_expert.numel() != w1.shape[0]:
        raise ValueError(f"got counts for {tokens_per_expert.numel()} experts, have {w1.shape[0]}")
    dtype = _compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    if not _grouped_mm_fits(x, w1):
        outputs = []
        for expert, group in enumerate(torch.split(x, tokens_per_expert.tolist(), dim=0)):
            hidden = silu_mul(group @ w1[expert].T, group @ w3[expert].T)
            outputs.append(hidden @ w2[expert].T)
        return torch.cat(outputs, dim=0)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)

    def gemm(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return grouped_mm(inputs, weight.transpose(-2, -1), offsets)

    return gemm(silu_mul(gemm(x, w1), gemm(x, w3)), w2)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights: w1, w3 [E, F, D] and w2 [E, D, F].

    forward(x [M, D] grouped by expert, tokens_per_expert [E]) -> [M, D]. The number of experts
    is read from w1's first dimension, so expert parallelism can keep a slice of them per rank.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x, self.w1, self.w2, self.w3, tokens_per_expert)


class MoE(nn.Module):
    """x [B, T, D] -> [B, T, D]; after each forward `aux_loss` holds coef * load-balancing loss.

    `collects_aux_loss` is cleared by the enclosing model once its forward ends, so a recompute
    of the block in the backward (full activation checkpointing) computes the loss again (the
    checkpoint needs the same saved tensors) but neither replaces the forward's aux loss nor
    keeps a second graph through the block's activations alive.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        expert_hidden: int,
        shared_experts: int = 0,
        aux_loss_coef: float = 0.01,
        norm_topk: bool = True,
        router: RouterSettings | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.router = nn.Linear(dim, num_experts, bias=False)  # logits; `routing` decides
        self.routing = make_routing(num_experts, top_k, router or RouterSettings())
        self.norm_topk = norm_topk
        self.experts = GroupedExperts(num_experts, dim, expert_hidden)
        # S shared SwiGLU experts of width F sum to one SwiGLU of width S * F.
        self.shared_expert = (
            FeedForward(dim, shared_experts * expert_hidden) if shared_experts > 0 else None
        )
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.aux_loss: torch.Tensor | None = None
        self.collects_aux_loss = True

    @property
    def norm_topk(self) -> bool:
        """Whether the top-k gates are renormalised to sum to 1 (the routing's setting)."""
        return self.routing.norm_topk

    @norm_topk.setter
    def norm_topk(self, value: bool) -> None:
        self.routing.norm_topk = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(batch * seq, dim)
        routing = self.routing(self.router(tokens))
        aux_loss = self.aux_loss_coef * load_balancing_loss(routing)  # a recompute saves the same
        if self.collects_aux_loss:
            self.aux_loss = aux_loss
        grouped, tokens_per_expert, handle = self.dispatcher.dispatch(tokens, routing)
        routed = self.dispatcher.combine(self.experts(grouped, tokens_per_expert), handle)
        out = routed.to(x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(batch, seq, dim)
