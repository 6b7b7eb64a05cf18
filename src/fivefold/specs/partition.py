"""How a model's layers are split over pipeline stages (virtual stages with interleaving).

Details: docs/internals.md (`fivefold.specs.partition`).
"""

from __future__ import annotations

from functools import lru_cache

from fivefold.errors import ConfigError
from fivefold.specs.flops import (
    attention_score_flops_per_token,
    head_flops_per_token,
    layer_matmul_flops_per_token,
)
from fivefold.specs.model import ModelSpec


def layer_costs(model: ModelSpec) -> list[float]:
    """Forward FLOPs per token of each transformer layer, in order."""
    attention = attention_score_flops_per_token(model, model.seq_len, causal=True)
    dense = layer_matmul_flops_per_token(model, moe=False) + attention
    moe = layer_matmul_flops_per_token(model, moe=True) + attention if model.is_moe else dense
    first_moe = model.dense_layers if model.is_moe else model.layers
    return [dense if i < first_moe else moe for i in range(model.layers)]


def stage_layer_counts(model: ModelSpec, stages: int) -> list[int]:
    """Layers per virtual stage (length `stages`, summing to `model.layers`); see module doc."""
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline stages = {stages!r}: must be a whole number >= 1.")
    if stages > model.layers:
        raise ConfigError(
            f"pp * vpp = {stages} pipeline stages exceed model.layers = {model.layers}: every "
            "stage needs at least one layer; lower plan.pp or plan.vpp."
        )
    return list(_counts(model, stages))


@lru_cache(maxsize=4096)
def _counts(model: ModelSpec, stages: int) -> tuple[int, ...]:
    costs = layer_costs(model)
    head = head_flops_per_token(model)
    if stages == 1:
        return (model.layers,)
    # The optimal maximum is one of the contiguous-run sums; binary search over candidate
    # thresholds with a greedy feasibility test from the back.
    lo = max(max(costs), costs[-1] + head)
    hi = sum(costs) + head
    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if _fill_from_back(costs, head, stages, mid) is None:
            lo = mid
        else:
            hi = mid
    counts = _fair_from_back(costs, head, stages, hi) or _fill_from_back(costs, head, stages, hi)
    assert counts is not None and sum(counts) == model.layers
    return tuple(counts)


def _fair_from_back(costs: list[float], head: float, stages: int, limit: float) -> list[int] | None:
    """Give each stage, from the last, the layers that bring it closest to its fair share of what
    remains, never above `limit`; None when the first stage would then exceed `limit`."""
    counts = [0] * stages
    remaining = sum(costs) + head
    i = len(costs) - 1
    for stage in range(stages - 1, 0, -1):
        load = head if stage == stages - 1 else 0.0
        fair = remaining / (stage + 1)
        while i >= stage:
            nxt = load + costs[i]
            if counts[stage] > 0 and (nxt > limit or abs(nxt - fair) >= abs(load - fair)):
                break
            load = nxt
            counts[stage] += 1
            i -= 1
        if load > limit * (1 + 1e-12):
            return None
        remaining -= load
    if sum(costs[: i + 1]) > limit * (1 + 1e-12):
        return None
    counts[0] = i + 1
    return counts


def _fill_from_back(costs: list[float], head: float, stages: int, limit: float) -> list[int] | None:
    """Pack layers into `stages` runs of cost <= limit from the last stage backwards, leaving at
    least one layer for each earlier stage; None when the first stage would exceed `limit`."""
    counts = [0] * stages
    i = len(costs) - 1  # the next layer to place, going backwards
    for stage in range(stages - 1, 0, -1):
        load = head if stage == stages - 1 else 0.0
        # Take layer i while it fits, always at least one, leaving one for each earlier stage.
        while i >= stage and (counts[stage] == 0 or load + costs[i] <= limit):
            load += costs[i]
            counts[stage] += 1
            i -= 1
        if load > limit:
            return None
    if sum(costs[: i + 1]) > limit * (1 + 1e-12):
        return None
    counts[0] = i + 1
    return counts
