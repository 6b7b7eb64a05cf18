"""What the layout search enumerates: the tp, cp, DP split (with its ZeRO stage), ep, schedule
and micro-batch choices of a model on a cluster, and the memory levers its second pass tries.
The rules are in docs/planner.md, "The layout search".
"""

from __future__ import annotations

import math
from typing import Any

from fivefold.planner.memory.levers import offloads
from fivefold.planner.search.outcomes import BatchTarget
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import ep_fits
from fivefold.specs.hardware import host
from fivefold.specs.model import ModelSpec
from fivefold.specs.optimizer import optimizer_plan_problems
from fivefold.specs.plan import ParallelPlan

MIN_CP_TOKENS = 1024
VPP_CHOICES = (2, 4, 8)
MAX_MICRO_BATCH = 64
# Memory levers, tried only when no layout fits without them, cheapest first in
# what they cost a step; only those fivefold's runtime runs (`ParallelPlan.runtime_problems`).
# FP8 compute changes the numerics: it is searched only when asked for (pinned, e.g. --fp8).
LEVER_FIELDS = ("offload", "optimizer_states", "fp8")
AUTO_LEVERS: tuple[dict[str, str], ...] = (
    {"optimizer_states": "8bit"},
    {"offload": "optimizer"},
    {"offload": "all"},
    {"optimizer_states": "8bit", "offload": "optimizer"},
    {"optimizer_states": "8bit", "offload": "all"},
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    out = []
    for tp in divisors(cluster.nvlink_gpus):  # one node, or a larger NVLink domain (NVL72)
        if cluster.world_size % tp or model.heads % tp or model.ffn % tp:
            continue
        kv_ok = model.kv_heads % tp == 0 if tp <= model.kv_heads else tp % model.kv_heads == 0
        shared = model.shared_experts * model.expert_ffn if model.is_moe else 0
        if kv_ok and shared % tp == 0:  # routed experts stay whole (geometry's expert rule)
            out.append(tp)
    return out


def cp_choices(model: ModelSpec, rest: int) -> list[int]:
    return [
        cp
        for cp in divisors(rest)
        if cp == 1 or (model.seq_len % (2 * cp) == 0 and model.seq_len // cp >= MIN_CP_TOKENS)
    ]


def dp_splits(
    dp: int, cp: int, tp: int = 1, gpus_per_node: int = 8, with_plain: bool = False
) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero): ZeRO 1-3 over every DP (x CP) rank, and HSDP.

    Plain DP (zero 0) is left out unless asked for (`with_plain`) or nothing can be sharded: a
    reduce-scatter plus an all-gather moves the same bytes as the all-reduce it replaces, so
    ZeRO-1 costs the same time and saves the optimizer state.
    """
    if dp * cp == 1:
        return [(1, 1, 0)]
    out = [(dp, 1, 0)] if with_plain else []
    out += [(1, dp, zero) for zero in (1, 2, 3)]
    out += [(dp // s, s, 3) for s in hsdp_shards(dp, cp, tp, gpus_per_node)]
    return out


def hsdp_shards(dp: int, cp: int, tp: int, gpus_per_node: int) -> list[int]:
    """HSDP shard sizes: groups spanning 1, 2, 4 or 8 whole nodes (at least 2, fewer than dp).

    Sharding inside a few nodes keeps the per-layer gathers off most of the network while the
    replicas only all-reduce gradients once per step; smaller or odd-sized groups are never
    better than one of these, or than ZeRO-3 over all DP ranks.
    """
    out = []
    for nodes in (1, 2, 4, 8):
        shard, rest = divmod(nodes * gpus_per_node, tp * cp)
        if rest == 0 and 1 < shard < dp and dp % shard == 0:
            out.append(shard)
    return out


def ep_choices(model: ModelSpec, dp_shard: int, cp: int, tp: int = 1) -> list[int]:
    if not model.is_moe:
        return [1]
    return [ep for ep in divisors(model.experts) if ep_fits(ep, dp_shard, cp, tp)]


def schedule_choices(model: ModelSpec, pp: int, pinned: str | None = None) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs for `pp` stages; `pinned`: the schedule the user fixed, searched
    even where the search would skip it."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    out += [("interleaved-1f1b", v) for v in VPP_CHOICES if pp * v <= model.layers]
    if 2 * pp <= model.layers:
        # DualPipeV differs from ZBV by hiding expert all-to-alls behind compute; for a dense
        # model it has the same bubble and one more chunk of activations in flight, so the
        # search skips it there unless it is pinned.
        out.append(("zbv", 2))
        if model.is_moe or pinned == "dualpipev":
            out.append(("dualpipev", 2))
    return out


def micro_batch_choices(target: BatchTarget, dp: int) -> list[int]:
    """Powers of two up to what one step of the target gives each DP rank."""
    most = max(1, math.floor(target.sequences * (1 + target.tolerance) / dp))
    out, mbs = [], 1
    while mbs <= min(most, MAX_MICRO_BATCH):
        out.append(mbs)
        mbs *= 2
    return out


def lever_probe(fields: dict[str, Any]) -> ParallelPlan:
    """A plan of `fields` on the smallest layout their own rules allow (offload "all" needs
    ZeRO-3 over at least 2 ranks), so that only what the runtime refuses for every layout counts."""
    base: dict[str, Any] = {"zero": 3, "dp_shard": 2} if fields.get("offload") == "all" else {}
    return ParallelPlan(**{**base, **fields})


def lever_sets(
    model: ModelSpec,
    cluster: ClusterSpec,
    fixed: dict[str, Any],
    optimizer: str = "adamw",
    runtime: bool = True,
) -> tuple[dict[str, str], ...]:
    """The memory levers the second pass tries (`AUTO_LEVERS`): those not fixed otherwise,
    that fivefold's runtime runs with `optimizer` (`runtime`: when its rules bind), and offload
    only where the catalog has the node's host."""
    out = []
    for levers in AUTO_LEVERS:
        if optimizer_plan_problems(optimizer, lever_probe(levers)):
            continue
        if any(k in fixed and fixed[k] != v for k, v in levers.items()):
            continue
        if all(k in fixed for k in levers):
            continue  # the first pass had it
        if runtime and lever_probe(levers).runtime_problems(model):
            continue
        if "offload" in levers and (
            host(cluster.gpu) is None or not offloads(ParallelPlan(**levers), cluster.device)
        ):
            continue
        out.append(levers)
    return tuple(out)
