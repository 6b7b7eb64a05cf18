"""Cheap bounds that let the layout search skip most full estimates.

Two bounds, both never above the value `estimate()` gives, so pruning with them loses nothing:

- `Bounds.memory`: `memory.stage_memory` for the first and the last pipeline rank (model state
  of their chunks, the largest chunk's activations times the micro-batches in flight, the named
  buffers and fragmentation), assembled from pieces cached on the fields they depend on. The
  estimate takes the maximum over every rank, so this is a lower bound (often the exact value:
  the first rank holds the most micro-batches, the last the logits). Under fivefold's eager
  memory model (the default options) the pieces do not add up that way, and the bound is the
  estimate's memory of those two ranks itself (`memory.all_stage_memory`, cached).
- `Bounds.step`: per layer, the compute and the in-stage communication `estimate` always exposes
  (tensor-parallel collectives, context-parallel exchange beyond what attention hides, expert
  all-to-alls, ZeRO-3 gathers beyond what the previous layer hides), summed into chunk times.
  A rank cannot finish before the first micro-batch has reached it and it has done all its work;
  in the loop schedules (gpipe, 1f1b, interleaved) the last micro-batch's backward must then go
  back through the stages before it. The estimate adds point-to-point transfers, the
  data-parallel tail and the optimizer step.

One `Bounds` object serves one search: its caches are keyed on the few plan fields each piece
depends on, so a bound costs a handful of dictionary lookups once a similar layout was seen.
`tests/planner/test_search.py` checks both bounds against `estimate` on many layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fivefold.planner.memory.activations import chunk_activation_bytes, layer_activation_bytes
from fivefold.planner.memory.buffers import other_terms
from fivefold.planner.memory.levers import memory_plan
from fivefold.planner.memory.model_states import chunk_state_bytes
from fivefold.planner.memory.options import MemoryOptions
from fivefold.planner.memory.stage import all_stage_memory
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel, efficiency_model
from fivefold.planner.step_time.compute import head_work
from fivefold.planner.step_time.layer_costs import layer_cost_key, layer_costs
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import chunks_of_rank, is_v_shaped
from fivefold.specs.model import ModelSpec
from fivefold.specs.partition import stage_layer_counts
from fivefold.specs.plan import ParallelPlan


@dataclass
class Bounds:
    model: ModelSpec
    cluster: ClusterSpec
    options: PlannerOptions = field(default_factory=PlannerOptions)
    efficiency: EfficiencyModel = field(default_factory=efficiency_model)

    def __post_init__(self) -> None:
        self.memory_options: MemoryOptions = self.options.memory()
        self._cache: dict[tuple, object] = {}

    def _cached(self, key: tuple, make):
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    # ---- layers per chunk ------------------------------------------------------------------
    def layers(self, stages: int) -> tuple[tuple[int, int], ...]:
        """(dense layers, MoE layers) of each virtual stage."""

        def make():
            counts = stage_layer_counts(self.model, stages)
            first_moe = self.model.dense_layers if self.model.is_moe else self.model.layers
            out, start = [], 0
            for n in counts:
                dense = max(0, min(start + n, first_moe) - start)
                out.append((dense, n - dense))
                start += n
            return tuple(out)

        return self._cached(("layers", stages), make)

    # ---- memory ------------------------------------------------------------------------------
    def memory(self, plan: ParallelPlan, inflight: list[int]) -> float:
        """Bytes the first or the last pipeline rank needs (the larger): `stage_memory`'s sum
        for those two ranks, assembled from cached pieces. fivefold's runtime (eager memory:
        the action walk, the gradients live at the peak, the block-backward peak) is not a
        sum of such pieces: its bound is the estimate's own memory of those two ranks."""
        if self.memory_options.eager:
            held = memory_plan(plan, self.cluster.device)
            ends = tuple(sorted({0, plan.pp - 1}))
            stages = all_stage_memory(self.model, held, inflight, self.memory_options, ends)
            return max(stage.total for stage in stages)
        v = is_v_shaped(plan.schedule, plan.pp)
        state = self._state(plan, v)
        acts = self._activations(plan, v)
        other = self._other(plan, v)
        working = self._working_set(plan)
        last = plan.pp - 1
        tensors = max(
            state[0] + acts[0] * inflight[0] + other[0],
            state[1] + acts[1] * inflight[last] + other[1],
        )
        return (tensors + working) * (1 + self.memory_options.fragmentation_fraction)

    def _first_and_last_rank(
        self,
        plan: ParallelPlan,
        v: bool,
        rank_bytes: Callable[[list[int], tuple[int, ...]], float],
    ) -> tuple[float, float]:
        """`rank_bytes(layers per virtual stage, the rank's virtual stages)` for the first and
        the last pipeline rank (`v`: the V-shaped chunk placement, part of the callers' keys)."""
        counts = stage_layer_counts(self.model, plan.pp * plan.vpp)
        first, last = (
            rank_bytes(counts, chunks_of_rank(plan.schedule, plan.pp, plan.vpp, r))
            for r in (0, plan.pp - 1)
        )
        return first, last

    def _other(self, plan: ParallelPlan, v: bool) -> tuple[float, float]:
        """The named buffers (`memory.other_terms`) of the first and last rank."""
        key = (
            "other",
            plan.tp,
            plan.sp,
            plan.cp,
            plan.micro_batch,
            plan.zero,
            plan.dp * plan.cp > 1,
            plan.ep,
            plan.precision,
            plan.pp,
            plan.vpp,
            v,
            plan.offload,
            plan.fp8,
        )

        def rank_bytes(counts: list[int], chunks: tuple[int, ...]) -> float:
            held = memory_plan(plan, self.cluster.device)
            return sum(
                other_terms(self.model, held, counts, list(chunks), self.memory_options).values()
            )

        return self._cached(key, lambda: self._first_and_last_rank(plan, v, rank_bytes))

    def _working_set(self, plan: ParallelPlan) -> float:
        """Full recompute re-materialises one layer's activations during its backward."""
        if plan.recompute != "full" or self.memory_options.activation_model != "korthikanti":
            return 0.0
        key = ("working", plan.tp, plan.sp, plan.cp, plan.micro_batch, plan.precision)
        return self._cached(
            key,
            lambda: layer_activation_bytes(
                self.model, plan, self.model.is_moe, self.memory_options, recompute="none"
            ),
        )

    def _state(self, plan: ParallelPlan, v: bool) -> tuple[float, float]:
        key = (
            "state",
            plan.tp,
            plan.ep,
            plan.zero,
            plan.dp_shard,
            plan.cp,
            plan.precision,
            plan.pp,
            plan.vpp,
            v,
            plan.offload,
            plan.optimizer_states,
        )

        def make():
            probe = ParallelPlan(
                tp=plan.tp,
                ep=plan.ep,
                zero=plan.zero,
                dp_shard=plan.dp_shard,
                cp=plan.cp,
                precision=plan.precision,
                offload=memory_plan(plan, self.cluster.device).offload,
                optimizer_states=plan.optimizer_states,
            )
            return self._first_and_last_rank(
                plan,
                v,
                lambda counts, chunks: sum(
                    chunk_state_bytes(
                        self.model, probe, counts, c, optimizer=self.memory_options.optimizer
                    ).total
                    for c in chunks
                ),
            )

        return self._cached(key, make)

    def _activations(self, plan: ParallelPlan, v: bool) -> tuple[float, float]:
        key = (
            "acts",
            plan.tp,
            plan.sp,
            plan.cp,
            plan.micro_batch,
            plan.recompute,
            plan.precision,
            plan.pp,
            plan.vpp,
            v,
        )

        def make():
            probe = ParallelPlan(
                tp=plan.tp,
                sp=plan.sp,
                cp=plan.cp,
                micro_batch=plan.micro_batch,
                recompute=plan.recompute,
                precision=plan.precision,
            )
            return self._first_and_last_rank(
                plan,
                v,
                lambda counts, chunks: max(
                    chunk_activation_bytes(self.model, probe, counts, c, self.memory_options)
                    for c in chunks
                ),
            )

        return self._cached(key, make)

    # ---- step time ---------------------------------------------------------------------------
    def step(self, plan: ParallelPlan) -> float:
        """Seconds a step of `plan` takes at least."""
        layer_key = layer_cost_key(plan)
        if layer_key.zero != 3:
            # Only ZeRO-3's per-layer gathers depend on the shard group: share the cache entry.
            layer_key = layer_key.with_(dp_shard=1)
        m = plan.grad_accum
        if plan.pp == 1:
            f, b = self._chunk_times(layer_key, plan.vpp)
            return m * (sum(f) + sum(b))
        v = is_v_shaped(plan.schedule, plan.pp)
        profile = self._cached(
            ("profile", layer_key, plan.pp, plan.vpp, v),
            lambda: self._pipeline_profile(layer_key, plan.pp, plan.vpp, plan.schedule),
        )
        return max(fixed + m * unit for fixed, unit in profile)

    def _layer(self, layer_key: ParallelPlan, moe: bool) -> tuple[float, float, float, float]:
        """(forward, backward, ZeRO-3 exposed per layer fwd, bwd) and first-layer extras."""

        def make():
            lc = layer_costs(
                self.model, layer_key, self.cluster, self.efficiency, self.options, moe
            )
            w = lc.work
            f = w.forward_s + lc.tp_fwd_s + lc.cp_fwd_s + lc.ep_fwd_s
            b = w.backward_input_s + w.backward_weight_s + lc.tp_bwd_s + lc.cp_bwd_s
            b += lc.ep_bwd_s
            zf = zb = 0.0
            gather, reduce = (lc.gather_s, lc.reduce_s) if layer_key.zero == 3 else (0.0, 0.0)
            if gather > 0:
                zf = max(0.0, gather - w.forward_s)
                zb = max(0.0, gather + reduce - w.backward_input_s - w.backward_weight_s)
            return f, b, zf, zb, gather, reduce

        return self._cached(("layer", layer_key, moe), make)

    def _chunk_times(self, layer_key: ParallelPlan, stages: int) -> tuple[list, list]:
        def make():
            dense = self._layer(layer_key, False)
            moe = self._layer(layer_key, True) if self.model.is_moe else dense
            forward, backward = [], []
            for n_dense, n_moe in self.layers(stages):
                f = b = 0.0
                for n, t in ((n_dense, dense), (n_moe, moe)):
                    if n:
                        f += n * (t[0] + t[2]) + t[4]
                        b += n * (t[1] + t[3]) + t[5]
                forward.append(f)
                backward.append(b)
            hw = head_work(self.model, layer_key, self.cluster.device, self.efficiency)
            forward[-1] += hw.forward_s
            backward[-1] += hw.backward_input_s + hw.backward_weight_s
            return forward, backward

        return self._cached(("chunks", layer_key, stages), make)

    def _pipeline_profile(
        self, layer_key: ParallelPlan, pp: int, vpp: int, schedule: str
    ) -> tuple[tuple[float, float], ...]:
        """Per rank (fixed seconds, seconds per micro-batch): step >= fixed + m * unit."""
        v = is_v_shaped(schedule, pp)
        forward, backward = self._chunk_times(layer_key, pp * vpp)
        f_before, b_before = [0.0], [0.0]
        for f, b in zip(forward, backward, strict=True):
            f_before.append(f_before[-1] + f)
            b_before.append(b_before[-1] + b)
        out = []
        for rank in range(pp):
            mine = chunks_of_rank(schedule, pp, vpp, rank)
            unit = sum(forward[c] + backward[c] for c in mine)
            first = mine[0]
            out.append((f_before[first] + (0.0 if v else b_before[first]), unit))
        return tuple(out)
