"""DeepSeek-V3's router settings of a `ModelSpec` (`fivefold.model.routers` builds them): the
checks of the sigmoid scores, group-limited top-k, routed scaling and bias balancing. Pure
Python (no torch)."""

from __future__ import annotations

from typing import Any

ModelSpec = Any  # a `fivefold.specs.model.ModelSpec` (which imports this module)

ROUTER_SCORES = ("softmax", "sigmoid")  # how router logits become expert scores
# the settings and the values that mean "softmax top-k" (a dense model leaves them so)
PLAIN_ROUTER = {
    "router_score": "softmax",
    "router_groups": 0,
    "router_top_groups": 0,
    "routed_scaling": 1.0,
    "router_bias_update_speed": 0.0,
}


def routes_otherwise(m: ModelSpec) -> bool:
    """Whether a router setting differs from the softmax top-k router's."""
    return any(getattr(m, k) != v for k, v in PLAIN_ROUTER.items())


def router_problems(m: ModelSpec) -> list[str]:
    """DeepSeek-V3's router settings (`fivefold.model.routers`)."""
    out = []
    if m.router_score not in ROUTER_SCORES:
        return [f"model.router_score = {m.router_score!r}: choose softmax or sigmoid."]
    groups, top = m.router_groups, m.router_top_groups
    if groups or top:
        if groups < 1 or m.experts % groups or m.experts // groups < 2:
            out.append(
                f"model.router_groups = {groups}: must divide model.experts = "
                f"{m.experts} into groups of at least 2 (a group scores by its top 2)."
            )
        elif not 1 <= top <= groups or top * (m.experts // groups) < m.top_k:
            out.append(
                f"model.router_top_groups = {top}: need 1 <= top_groups <= router_groups "
                f"and top_groups x experts per group >= top_k = {m.top_k}."
            )
    if not (0 < m.routed_scaling < float("inf")):
        out.append(f"model.routed_scaling = {m.routed_scaling}: must be positive, e.g. 1.")
    speed = m.router_bias_update_speed
    if not (0 <= speed < float("inf")):
        out.append(f"model.router_bias_update_speed = {speed}: must be >= 0, e.g. 0.001.")
    elif speed and m.router_score != "sigmoid":
        out.append(
            "model.router_bias_update_speed balances the sigmoid router's score-correction "
            'bias: set model.router_score = "sigmoid" or leave it at 0.'
        )
    return out
