"""Cheap bounds that let the layout search skip most full estimates.

Two bounds, both never above the value `estimate()` would give, so the search stays exact:

- `memory_lower_bound`: the model state of the chunks a pipeline rank holds plus its largest
  chunk's activations times the micro-batches in flight, plus the CUDA context, for the first
  and the last pipeline rank. The estimate adds the remaining buffers (logits, ZeRO-3 gathers,
  communication buffers, the recompute working set) and fragmentation on top.
- `step_lower_bound`: the per-layer compute and in-stage communication that is always exposed
  (tensor-parallel collectives, context-parallel exchange beyond what attention hides, expert
  all-to-alls), summed into chunk times; then a rank cannot finish before the first micro-batch
  has reached it, it has done all its work, and (one-stage-per-chunk-in-a-loop schedules) the
  last micro-batch's backward has gone back through the stages before it. The estimate adds
  point-to-point transfers, ZeRO-3 gathers, the data-parallel tail and the optimizer step.

The pieces are cached on the plan fields they depend on, so a bound costs a few dictionary
lookups once the search has seen a similar layout. Tests check both bounds against `estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.planner.calibration import EfficiencyModel, efficiency_model
from fivefold.planner.compute import head_work
from fivefold.planner.estimate import _layer_costs, _layer_key
from fivefold.planner.memory import (
    MemoryOptions,
    chunk_activation_bytes,
    chunk_layers,
    chunk_state_bytes,
)
from fivefold.planner.options import PlannerOptions
from fivefold.planner.partition import stage_layer_counts
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan

V_SCHEDULES = ("zbv", "dualpipev")


@dataclass(frozen=True)
class BoundContext:
    model: ModelSpec
    cluster: ClusterSpec
    options: PlannerOptions
    efficiency: EfficiencyModel

    @classmethod
    def default(cls, model: ModelSpec, cluster: ClusterSpec) -> BoundContext:
        return cls(model, cluster, PlannerOptions(), efficiency_model())

    @property
    def memory_options(self) -> MemoryOptions:
        return self.options.memory()


# ---- placement ------------------------------------------------------------------------------
@lru_cache(maxsize=65536)
def rank_chunks(schedule: str, pp: int, vpp: int, rank: int) -> tuple[int, ...]:
    """Virtual stages of pipeline rank `rank` (the placement of `memory.chunks_of_rank`)."""
    if schedule in V_SCHEDULES and pp > 1:
        return (rank, 2 * pp - 1 - rank)
    return tuple(range(rank, pp * vpp, pp))


# ---- memory --------------------------------------------------------------------------------
def memory_lower_bound(ctx: BoundContext, plan: ParallelPlan, inflight: list[int]) -> float:
    """Bytes the first or last pipeline rank needs at least (the larger of the two)."""
    per_rank = _memory_profile(
        ctx, _state_key(plan), _activation_key(plan), plan.pp, plan.vpp, _shape(plan)
    )
    ranks = (0, plan.pp - 1)
    need = max(state + acts * inflight[r] for r, (state, acts) in zip(ranks, per_rank, strict=True))
    return need + ctx.memory_options.cuda_context_bytes


def _shape(plan: ParallelPlan) -> str:
    """What the chunk placement depends on: 'v' for V schedules, 'loop' otherwise."""
    return "v" if plan.schedule in V_SCHEDULES and plan.pp > 1 else "loop"


@lru_cache(maxsize=65536)
def _memory_profile(
    ctx: BoundContext, state_key: ParallelPlan, act_key: ParallelPlan, pp: int, vpp: int,
    shape: str,
) -> tuple[tuple[float, float], ...]:
    """(model state, largest chunk's activations per micro-batch) of the first and last rank."""
    counts = list(_counts(ctx.model, pp * vpp))
    name = "zbv" if shape == "v" else "1f1b"
    out = []
    for rank in (0, pp - 1):
        chunks = rank_chunks(name, pp, vpp, rank)
        state = sum(chunk_state_bytes(ctx.model, state_key, counts, c).total for c in chunks)
        acts = max(
            chunk_activation_bytes(ctx.model, act_key, counts, c, ctx.memory_options)
            for c in chunks
        )
        out.append((state, acts))
    return tuple(out)


def _state_key(plan: ParallelPlan) -> ParallelPlan:
    return ParallelPlan(
        tp=plan.tp, ep=plan.ep, zero=plan.zero, dp_shard=plan.dp_shard, cp=plan.cp,
        precision=plan.precision,
    )  # fmt: skip


def _activation_key(plan: ParallelPlan) -> ParallelPlan:
    return ParallelPlan(
        tp=plan.tp, sp=plan.sp, cp=plan.cp, micro_batch=plan.micro_batch,
        recompute=plan.recompute, precision=plan.precision,
    )  # fmt: skip


@lru_cache(maxsize=4096)
def _counts(model: ModelSpec, stages: int) -> tuple[int, ...]:
    return tuple(stage_layer_counts(model, stages))


# ---- step time -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _LayerTimes:
    forward_s: float  # compute + exposed in-stage communication, one micro-batch
    backward_s: float  # input and weight gradients, with recompute


@lru_cache(maxsize=65536)
def _layer_times(ctx: BoundContext, key: ParallelPlan, moe: bool) -> _LayerTimes:
    lc = _layer_costs(ctx.model, key, ctx.cluster, ctx.efficiency, ctx.options, moe)
    w = lc.work
    forward = w.forward_s + lc.tp_fwd_s + lc.cp_fwd_s + lc.ep_fwd_s
    backward = w.backward_input_s + w.backward_weight_s + lc.tp_bwd_s + lc.cp_bwd_s + lc.ep_bwd_s
    return _LayerTimes(forward, backward)


def _zero3_exposed(ctx: BoundContext, key: ParallelPlan, moe: bool, layers: int) -> _LayerTimes:
    """ZeRO-3 gathers a layer's weights behind the previous layer's compute; the first of a
    chunk and whatever compute cannot cover stay exposed (as `estimate` counts them)."""
    if key.zero != 3 or layers == 0:
        return _LayerTimes(0.0, 0.0)
    lc = _layer_costs(ctx.model, key, ctx.cluster, ctx.efficiency, ctx.options, moe)
    if lc.gather_s <= 0:
        return _LayerTimes(0.0, 0.0)
    w = lc.work
    f = layers * max(0.0, lc.gather_s - w.forward_s) + lc.gather_s
    b = layers * max(0.0, lc.gather_s + lc.reduce_s - w.backward_input_s - w.backward_weight_s)
    return _LayerTimes(f, b + lc.reduce_s)


@lru_cache(maxsize=16384)
def _head_times(ctx: BoundContext, key: ParallelPlan) -> _LayerTimes:
    hw = head_work(ctx.model, key, ctx.cluster.device, ctx.efficiency)
    return _LayerTimes(hw.forward_s, hw.backward_input_s + hw.backward_weight_s)


@lru_cache(maxsize=65536)
def chunk_times(ctx: BoundContext, key: ParallelPlan, stages: int) -> tuple[_LayerTimes, ...]:
    """Lower bounds of each virtual stage's forward and backward time for one micro-batch;
    `key` is `estimate._layer_key(plan)`."""
    counts = list(_counts(ctx.model, stages))
    dense = _layer_times(ctx, key, False)
    moe = _layer_times(ctx, key, True) if ctx.model.is_moe else dense
    out = []
    for c in range(stages):
        n_dense, n_moe = chunk_layers(ctx.model, counts, c)
        f = n_dense * dense.forward_s + n_moe * moe.forward_s
        b = n_dense * dense.backward_s + n_moe * moe.backward_s
        for n, is_moe in ((n_dense, False), (n_moe, True)):
            z = _zero3_exposed(ctx, key, is_moe, n)
            f, b = f + z.forward_s, b + z.backward_s
        out.append(_LayerTimes(f, b))
    head = _head_times(ctx, key)
    last = out[-1]
    out[-1] = _LayerTimes(last.forward_s + head.forward_s, last.backward_s + head.backward_s)
    return tuple(out)


@lru_cache(maxsize=65536)
def _pipeline_profile(
    ctx: BoundContext, key: ParallelPlan, pp: int, vpp: int, shape: str
) -> tuple[tuple[float, float], ...]:
    """Per rank (fixed seconds, seconds per micro-batch): the step is at least
    max over ranks of fixed + m * per-micro-batch (see the module docstring)."""
    chunks = chunk_times(ctx, key, pp * vpp)
    name = "zbv" if shape == "v" else "1f1b"
    forward_before = [0.0]
    backward_before = [0.0]
    for c in chunks:
        forward_before.append(forward_before[-1] + c.forward_s)
        backward_before.append(backward_before[-1] + c.backward_s)
    out = []
    for rank in range(pp):
        mine = rank_chunks(name, pp, vpp, rank)
        first = min(mine)
        unit = sum(chunks[c].forward_s + chunks[c].backward_s for c in mine)
        fixed = forward_before[first] + (backward_before[first] if shape == "loop" else 0.0)
        out.append((fixed, unit))
    return tuple(out)


def step_lower_bound(ctx: BoundContext, plan: ParallelPlan) -> float:
    """Seconds a step of `plan` takes at least (see the module docstring)."""
    key = _layer_key(plan)
    m = plan.grad_accum
    if plan.pp == 1:
        return m * sum(c.forward_s + c.backward_s for c in chunk_times(ctx, key, plan.vpp))
    profile = _pipeline_profile(ctx, key, plan.pp, plan.vpp, _shape(plan))
    return max(fixed + m * unit for fixed, unit in profile)
