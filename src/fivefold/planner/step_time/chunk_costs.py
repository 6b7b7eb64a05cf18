"""The costs of one virtual stage (chunk) per micro-batch: its layers' forward, input-gradient
and weight-gradient times with the in-stage communication they expose (`layer_costs`), the
embedding and head on the first and last chunk, and the communication totals per kind. The
rules are in docs/planner.md, sections 2 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.comm import all_gather_time_s, all_reduce_time_s, plan_link
from fivefold.planner.step_time.compute import embedding_work, head_work
from fivefold.planner.step_time.layer_costs import (
    LayerCosts,
    collective_gap_s,
    dtensor_small_collectives_s,
    layer_costs,
)
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe


@dataclass(frozen=True)
class ChunkCosts:
    """Seconds per micro-batch of one chunk on its rank; the communication as (exposed s,
    transfer s, bytes) per kind."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    compute_s: float  # compute part of F + B + W
    tp: tuple[float, float, float]  # exposed, time, bytes (per micro-batch)
    cp: tuple[float, float, float]
    ep: tuple[float, float, float]
    zero: tuple[float, float, float]  # ZeRO-3 parameter gathers
    zero_rs: tuple[float, float, float]  # ZeRO-3 gradient reduce-scatters


def _triple() -> list[float]:
    return [0.0, 0.0, 0.0]


@dataclass
class _Sums:
    """The running totals of a chunk, added to in a fixed order (floating point)."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    compute: float = 0.0
    tp: list[float] = field(default_factory=_triple)
    cp: list[float] = field(default_factory=_triple)
    ep: list[float] = field(default_factory=_triple)
    zero: list[float] = field(default_factory=_triple)
    zero_rs: list[float] = field(default_factory=_triple)


@lru_cache(maxsize=65536)
def chunk_costs_of(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    n_dense: int,
    n_moe: int,
    first: bool,
    last: bool,
) -> ChunkCosts:
    """Costs of a virtual stage with `n_dense` + `n_moe` layers (plan = `layer_cost_key(plan)`)."""
    s = _Sums()
    for n, moe in ((n_dense, False), (n_moe, True)):
        if n == 0:
            continue
        lc = layer_costs(model, plan, cluster, eff, opts, moe)
        _add_layers(s, lc, n)
        if plan.zero == 3 and lc.gather_s > 0:
            _add_zero3(s, lc, n, opts.dp_overlap)
    device = cluster.device
    ends = ([embedding_work(model, plan, device, eff)] if first else []) + (
        [head_work(model, plan, device, eff)] if last else []
    )
    for hw in ends:
        s.f += hw.forward_s
        s.b += hw.backward_input_s
        s.w += hw.backward_weight_s
        s.compute += hw.total_s
    if plan.tp > 1 and (first or last):
        _add_tp_region_ends(s, model, plan, cluster, eff, last)
    if plan.tp > 1 and opts.runtime == "fivefold-eager":
        small_f, small_b = dtensor_small_collectives_s(
            model, plan, cluster, eff, n_dense + n_moe, last
        )
        s.f, s.b = s.f + small_f, s.b + small_b
        s.tp = [s.tp[0] + small_f + small_b, s.tp[1] + small_f + small_b, s.tp[2]]
    return ChunkCosts(
        s.f,
        s.b,
        s.w,
        s.compute,
        tuple(s.tp),
        tuple(s.cp),
        tuple(s.ep),
        tuple(s.zero),
        tuple(s.zero_rs),
    )


def _add_layers(s: _Sums, lc: LayerCosts, n: int) -> None:
    """`n` layers of costs `lc`: compute and the exposed TP, CP and EP communication."""
    wk = lc.work
    s.f += n * (wk.forward_s + lc.tp_fwd_s + lc.cp_fwd_s + lc.ep_fwd_s)
    s.b += n * (wk.backward_input_s + lc.tp_bwd_s + lc.cp_bwd_s + lc.ep_bwd_s)
    s.w += n * wk.backward_weight_s
    s.compute += n * wk.total_s
    s.tp = [
        s.tp[0] + n * (lc.tp_fwd_s + lc.tp_bwd_s),
        s.tp[1] + n * lc.tp_time_s,
        s.tp[2] + n * lc.tp_bytes,
    ]
    s.cp = [
        s.cp[0] + n * (lc.cp_fwd_s + lc.cp_bwd_s),
        s.cp[1] + n * lc.cp_time_s,
        s.cp[2] + n * lc.cp_bytes,
    ]
    ep_time = lc.ep_fwd_s + lc.ep_bwd_s
    s.ep = [s.ep[0] + n * ep_time, s.ep[1] + n * ep_time, s.ep[2] + n * lc.ep_bytes]


def _add_zero3(s: _Sums, lc: LayerCosts, n: int, dp_overlap: bool) -> None:
    """ZeRO-3's per-layer gathers and reduce-scatters of `n` layers: each layer's gather hides
    behind the previous layer's compute, its gradient reduce-scatter behind the next layer's
    backward; the first gather and the last reduce-scatter of the chunk cannot hide. Without
    `dp_overlap` (a CPU: collectives take the cores' time) nothing hides."""
    wk = lc.work
    hide_f = wk.forward_s if dp_overlap else 0.0
    hide_b = wk.backward_input_s + wk.backward_weight_s if dp_overlap else 0.0
    exposed_f = n * max(0.0, lc.gather_s - hide_f) + lc.gather_s
    exposed_b = n * max(0.0, lc.gather_s + lc.reduce_s - hide_b)
    s.f += exposed_f + n * lc.gather_copy_s
    s.b += exposed_b + lc.reduce_s + n * (lc.gather_copy_s + lc.reduce_copy_s)
    s.compute += n * (2 * lc.gather_copy_s + lc.reduce_copy_s)
    gather_share = lc.gather_s / (lc.gather_s + lc.reduce_s)
    s.zero = [
        s.zero[0] + exposed_f + exposed_b * gather_share,
        s.zero[1] + 2 * n * lc.gather_s,
        s.zero[2] + 2 * n * lc.gather_bytes,
    ]
    s.zero_rs = [
        s.zero_rs[0] + exposed_b * (1 - gather_share) + lc.reduce_s,
        s.zero_rs[1] + n * lc.reduce_s,
        s.zero_rs[2] + n * lc.reduce_bytes,
    ]


def _add_tp_region_ends(
    s: _Sums,
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    last: bool,
) -> None:
    """The embedding's (and the head's) entry into / exit from the sequence-parallel region,
    each a DTensor redistribution with its host seconds (`Link.host_s`)."""
    link = plan_link(cluster, plan, "tp", eff, collective_gap_s(model, plan, cluster, eff))
    size = (
        plan.micro_batch
        * model.seq_len
        / plan.cp
        * model.hidden
        * recipe(plan.precision).activation_bytes
    )
    one = (
        all_gather_time_s(size, plan.tp, link) + link.host_s("all_gather", plan.tp)
        if plan.sp
        else all_reduce_time_s(size, plan.tp, link)
    )
    s.f += one
    s.b += one if last else 0.0
    extra = one * (2 if last else 1)
    s.tp = [s.tp[0] + extra, s.tp[1] + extra, s.tp[2] + size]
