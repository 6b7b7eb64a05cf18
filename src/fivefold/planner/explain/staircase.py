"""The rule-of-thumb staircase of the distributed-training guides, taken literally and costed.

TP fills a node, then the fewest pipeline stages that fit, DP the rest with ZeRO-1, micro-batch
1, full recompute, accumulation to the batch target, CP only if still needed. The explanation
(`fivefold.planner.explain.result`) prices its first fitting layout against the searched one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fivefold.planner.search.candidates import divisors, tp_choices
from fivefold.planner.search.outcomes import BatchTarget
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan

RULE = (
    "The textbook rule of thumb taken literally (the decision staircase of the "
    "distributed-training guides: TP fills the node, the fewest pipeline "
    "stages that fit, DP the rest with ZeRO-1, micro-batch 1, full recompute, "
    "accumulation to the target, CP only if still needed)"
)


def staircase_plans(
    model: ModelSpec, cluster: ClusterSpec, target: BatchTarget
) -> list[ParallelPlan]:
    """The staircase's layouts in the order it tries them: TP = the largest valid degree in a
    node, then PP = 1, 2, 4, ... with CP = 1, then the same with CP = 2, 4, 8 (ZeRO-1, mbs 1,
    full recompute, 1F1B, accumulation to the batch target)."""
    tp = max(tp_choices(model, cluster))
    world = cluster.world_size
    out = []
    for cp in (1, 2, 4, 8):
        if world % (tp * cp) or (cp > 1 and model.seq_len % (2 * cp)):
            continue
        for pp in divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            accum = target.accumulation(1, dp)
            if pp > model.layers or accum is None:
                continue
            zero = 1 if dp * cp > 1 else 0
            out.append(
                ParallelPlan(
                    tp=tp,
                    sp=tp > 1,
                    pp=pp,
                    cp=cp,
                    dp_shard=dp if zero else 1,
                    dp_replicate=1 if zero else dp,
                    zero=zero,
                    micro_batch=1,
                    grad_accum=accum,
                    recompute="full",
                )
            )
    return out


def rule_of_thumb_line(
    search: Any, target: BatchTarget, chosen: ParallelPlan, slower: Callable[[Any], str]
) -> str:
    """The staircase's first fitting layout, costed by `search` (the search state) against the
    `chosen` one (`slower` words the difference); the memory levers asked for apply to it too."""
    outcome = None
    for plan in staircase_plans(search.model, search.cluster, target):
        outcome = search.evaluate(plan.with_(**search.lever_pins))
        if outcome.fits:
            break
    if outcome is None:
        return ""
    if outcome.plan == chosen:
        return f"{RULE} gives this very layout."
    if not outcome.fits:
        return f"{RULE} finds nothing that fits; closest {outcome.plan.describe()}: " + (
            outcome.reason.rstrip(".") + "."
        )
    return f"{RULE} gives {outcome.plan.describe()}: {slower(outcome.estimate)}."
