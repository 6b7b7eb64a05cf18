"""MoE routers, chosen from the `ModelSpec`: the softmax top-k router (Mixtral, Qwen-MoE) and
DeepSeek-V3's sigmoid router, as `transformers`' DeepseekV3TopkRouter computes it:

- scores s = sigmoid(logits) (fp32); the experts are chosen by s + b, b the score-correction
  bias (a buffer, not trained by gradients);
- group-limited choice: the experts form `groups` equal groups, each scored by the sum of its
  two best s + b; only the experts of the `top_groups` best groups may be chosen;
- gates: the chosen experts' s (not s + b), divided by their sum, times `scaling`.

The auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): after each optimizer step
b_e += speed * sign(mean load - load_e), the loads being the tokens routed to each expert over
the step on every rank that saw other tokens of the same layer (`balance_router_biases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.specs.model import ModelSpec


@dataclass
class Routing:
    """The router's decision for N tokens.

    expert_indices: LongTensor [N, K], the chosen experts of each token (global expert ids).
    gates:          [N, K] weights of those experts (sum to 1 per token when renormalised,
                    times the routed scaling), differentiable.
    probs:          fp32 [N, E] the scores normalised over all experts (for the load-balancing
                    loss).
    num_experts:    E, the global number of routed experts.
    """

    expert_indices: torch.Tensor
    gates: torch.Tensor
    probs: torch.Tensor
    num_experts: int


@dataclass(frozen=True)
class RouterSettings:
    """How a MoE layer routes (`router_settings`); the defaults are the softmax router."""

    score: str = "softmax"
    groups: int = 0  # 0: no group limit
    top_groups: int = 0
    scaling: float = 1.0
    bias_update_speed: float = 0.0


def router_settings(spec: ModelSpec) -> RouterSettings:
    return RouterSettings(
        spec.router_score,
        spec.router_groups,
        spec.router_top_groups,
        spec.routed_scaling,
        spec.router_bias_update_speed,
    )


def route(router_logits: torch.Tensor, top_k: int, norm_topk: bool = True) -> Routing:
    """Softmax over experts (fp32), keep the top-k, renormalise their gates to sum to 1 when
    `norm_topk` (Mixtral; Qwen3-MoE's `norm_topk_prob`); logits [N, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_probs, expert_indices = torch.topk(probs, top_k, dim=-1)
    gates = top_probs / top_probs.sum(dim=-1, keepdim=True) if norm_topk else top_probs
    return Routing(expert_indices, gates, probs, router_logits.shape[-1])


def _group_mask(choice: torch.Tensor, groups: int, top_groups: int) -> torch.Tensor:
    """Bool [N, E]: the experts of each token's `top_groups` best groups (by the sum of each
    group's two best `choice` scores); choice [N, E]."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, groups, experts // groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
    best = group_scores.topk(top_groups, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand(-1, -1, experts // groups).reshape(tokens, experts)


def route_sigmoid(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    settings: RouterSettings,
    norm_topk: bool = True,
) -> Routing:
    """DeepSeek-V3's routing (module docstring; the chosen scores divided by their sum only when
    `norm_topk`, its `norm_topk_prob`); logits [N, E], bias fp32 [E]."""
    scores = torch.sigmoid(router_logits.float())
    choice = scores.detach() + bias
    if settings.groups > 1:
        keep = _group_mask(choice, settings.groups, settings.top_groups)
        choice = choice.masked_fill(~keep, float("-inf"))
    expert_indices = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    chosen = scores.gather(1, expert_indices)
    if norm_topk:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    gates = chosen * settings.scaling
    probs = scores / scores.sum(dim=-1, keepdim=True)
    return Routing(expert_indices, gates, probs, router_logits.shape[-1])


class SoftmaxRouting(nn.Module):
    """Router logits [N, E] -> `route` (softmax top-k)."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk = True

    def forward(self, logits: torch.Tensor) -> Routing:
        return route(logits, self.top_k, self.norm_topk)


class SigmoidRouting(nn.Module):
    """Router logits [N, E] -> `route_sigmoid` (DeepSeek-V3).

    Owns `score_bias` (fp32 [E], a persistent buffer: saved with the model) and `expert_load`
    (fp32 [E], the tokens routed to each expert since the last bias update, counted in training
    forwards with gradients while `counts_load`: the model sets it for its forward and clears
    it after, so neither a recompute nor the pipeline's shape inference counts).
    """

    def __init__(self, num_experts: int, top_k: int, settings: RouterSettings) -> None:
        super().__init__()
        self.top_k = top_k
        self.settings = settings
        self.norm_topk = True
        self.counts_load = True
        self.register_buffer("score_bias", torch.zeros(num_experts))
        self.register_buffer("expert_load", torch.zeros(num_experts), persistent=False)

    def forward(self, logits: torch.Tensor) -> Routing:
        routing = route_sigmoid(logits, self.score_bias, self.top_k, self.settings, self.norm_topk)
        if self.counts_load and self._counts_now():
            flat = routing.expert_indices.flatten()
            self.expert_load.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return routing

    def _counts_now(self) -> bool:
        """A training forward with gradients (not an evaluation)."""
        speed = self.settings.bias_update_speed
        return bool(speed) and self.training and torch.is_grad_enabled()


def make_routing(num_experts: int, top_k: int, settings: RouterSettings) -> nn.Module:
    """The routing module `settings` asks for."""
    if settings.score == "sigmoid":
        return SigmoidRouting(num_experts, top_k, settings)
    return SoftmaxRouting(top_k)


@torch.no_grad()
def balance_router_biases(
    routings: list[nn.Module], group: dist.ProcessGroup | None = None
) -> None:
    """The auxiliary-loss-free update of every sigmoid router with a bias update speed:
    b += speed * sign(mean load - load), the loads summed over `group` (the ranks holding the
    same layers with other tokens: data x context parallel), then reset. One all-reduce for
    all routers; none without routers that balance."""
    routers = [
        r for r in routings if isinstance(r, SigmoidRouting) and r.settings.bias_update_speed
    ]
    if not routers:
        return
    loads = torch.stack([r.expert_load for r in routers])  # [R, E]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    error = loads.mean(dim=-1, keepdim=True) - loads
    for router, err in zip(routers, error, strict=True):
        router.score_bias.add_(torch.sign(err), alpha=router.settings.bias_update_speed)
        router.expert_load.zero_()
