"""Which rates of a measured device a plan reads inside the measured shapes and which beyond.

`MeasuredRates` reads every GEMM and attention rate from the profile's rows in log space
(`fivefold.planner.rates.shape_interp.log_shape_interp`) and, beyond the measured shapes, takes the
edge's value; a grouped expert matmul takes its nearest measured shape. A read beyond the
measured range in any coordinate is an extrapolation: `coverage` lists every read of one
layer kind's matmuls (three passes each), the LM head, the routed experts and the attention
core for a plan, and `Coverage.describe` says how many were measured, interpolated and
extrapolated, naming each extrapolated coordinate, for the printed prediction.

Collectives are priced between the sizes `calibrate` measured (`collective_samples`): below the
smallest at its time, beyond the largest at the fitted bandwidth. `coverage` lists the message
each kind of collective a plan issues sends (one layer's activations for tensor, pipeline and
expert parallelism; one block's gradients for data parallelism) and flags those beyond the
largest measured size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fivefold.planner.memory.model_states import layer_params_per_rank
from fivefold.planner.rates.collective_samples import nearest_samples
from fivefold.planner.rates.device import MeasuredRates, rates_for
from fivefold.planner.rates.shape_interp import beyond_range
from fivefold.planner.step_time.comm import activation_bytes, stage_boundary_bytes
from fivefold.planner.step_time.compute import attention_span
from fivefold.planner.step_time.layer_matmuls import eager_matmuls, expert_projections
from fivefold.specs.geometry import axis_groups, rank_tokens
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe
from fivefold.units import MiB

INSIDE_WORDS = {"grouped experts": "at the nearest measured shape"}  # no interpolation there
BEYOND_WORDS = {"collectives": "the largest measured size's time, the rest at the fitted bandwidth"}
PASS_SHAPES = {  # the (m, n, k) each pass of a forward (m, n, k) matmul runs at
    "nt": lambda m, n, k: (m, n, k),
    "nn": lambda m, n, k: (m, k, n),
    "tn": lambda m, n, k: (n, k, m),
}


@dataclass(frozen=True)
class Read:
    """One rate read: its table (`part`), the shape read, whether a measured row has that very
    shape, and the coordinates beyond the measured range (empty: interpolated or measured)."""

    part: str
    shape: str
    measured: bool
    beyond: tuple[str, ...]


@dataclass(frozen=True)
class Coverage:
    reads: tuple[Read, ...]

    def count(self, part: str) -> tuple[int, int, int]:
        """(measured, interpolated, extrapolated) reads of `part`."""
        mine = [r for r in self.reads if r.part == part]
        beyond = sum(1 for r in mine if r.beyond)
        measured = sum(1 for r in mine if r.measured and not r.beyond)
        return measured, len(mine) - beyond - measured, beyond

    def describe(self) -> str:
        """E.g. 'Device model: GEMM passes 3 measured, 21 interpolated, 2 EXTRAPOLATED (the
        measured edge's rate: 8192 x 384 x 384 nt: m 8192 > 2048; ...); attention 1
        interpolated.'"""
        parts = []
        for part in dict.fromkeys(r.part for r in self.reads):
            measured, inside, beyond = self.count(part)
            inside_word = INSIDE_WORDS.get(part, "interpolated")
            words = [f"{n} {w}" for n, w in ((measured, "measured"), (inside, inside_word)) if n]
            if beyond:
                far = [f"{r.shape}: {', '.join(r.beyond)}" for r in self.reads_of(part) if r.beyond]
                shown = "; ".join(far[:3]) + ("; ..." if len(far) > 3 else "")
                how = BEYOND_WORDS.get(part, "the measured edge's rate")
                words.append(f"{beyond} EXTRAPOLATED ({how}: {shown})")
            parts.append(f"{part} {', '.join(words)}")
        return "Device model: " + "; ".join(parts) + "."

    def reads_of(self, part: str) -> list[Read]:
        return [r for r in self.reads if r.part == part]

    @property
    def extrapolated(self) -> bool:
        return any(r.beyond for r in self.reads)


def coverage(rates: MeasuredRates, model: ModelSpec, plan: ParallelPlan) -> Coverage:
    """Every rate `plan`'s compute reads on this device (module doc)."""
    dtype = recipe(plan.precision).compute_dtype
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    forward = [(m, n, k) for m, n, k, _ in eager_matmuls(model, plan, model.is_moe)]
    forward.append((tokens, model.vocab / plan.tp, model.hidden))  # the LM head
    reads = []
    for m, n, k in dict.fromkeys(forward):
        for layout, at in PASS_SHAPES.items():
            points, _ = rates.gemm_points(dtype, layout)
            shape = tuple(max(1.0, x) for x in at(m, n, k))
            reads.append(_read("GEMM passes", shape, layout, points, "m n k"))
    if model.is_moe:
        reads += _grouped_reads(rates, model, plan, dtype)
    table, _ = rates.attention_table(dtype, plan.cp if plan.cp_kind in ("ring", "allgather") else 1)
    where = (attention_span(model, plan), model.head_dim, plan.micro_batch * model.heads / plan.tp)
    points = [((a.seq, a.head_dim, a.batch * a.heads), 1.0) for a in table]
    reads.append(_read("attention", where, "", points, "seq head_dim rows"))
    return Coverage(tuple(reads + _collective_reads(rates, model, plan)))


def plan_messages(model: ModelSpec, plan: ParallelPlan) -> list[tuple[str, int, float]]:
    """(op, group ranks, bytes of one call) of each kind of collective `plan` issues: tensor
    parallelism's activations (all-gather and reduce-scatter with SP, else all-reduce), the
    pipeline's stage boundary (sequence-sharded under SP), expert parallelism's routed tokens
    (top_k per token), and one
    block's gradients over data parallelism (reduce-scatter and all-gather under ZeRO, else
    all-reduce; HSDP's replicas all-reduce the shard)."""
    rec = recipe(plan.precision)
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    activations = activation_bytes(tokens, model.hidden, rec.activation_bytes)
    out: list[tuple[str, int, float]] = []
    if plan.tp > 1:
        ops = ("all_gather", "reduce_scatter") if plan.sp else ("all_reduce",)
        out += [(op, plan.tp, activations) for op in ops]
    if plan.pp > 1:
        out.append(("send_recv", 2, stage_boundary_bytes(model, plan)))
    if plan.ep > 1 and model.is_moe:
        out.append(("all_to_all", plan.ep, activations * model.top_k))
    lp = layer_params_per_rank(model, model.is_moe, plan.tp, plan.ep, plan.etp)
    block = (lp.dense + lp.replicated + lp.experts) * rec.grad_bytes
    groups = axis_groups(plan)
    shard = groups["dp_shard_cp"][0]
    if plan.zero == 0 and groups["dp_cp"][0] > 1:
        out.append(("all_reduce", groups["dp_cp"][0], block))
    if plan.zero > 0 and shard > 1:
        out += [("reduce_scatter", shard, block), ("all_gather", shard, block)]
    if plan.zero > 0 and plan.dp_replicate > 1:
        out.append(("all_reduce", plan.dp_replicate, block / (shard if plan.zero >= 2 else 1)))
    return out


def _collective_reads(rates: MeasuredRates, model: ModelSpec, plan: ParallelPlan) -> list[Read]:
    """Each of `plan_messages` against the sizes measured for the nearest group (none when the
    profile has no size samples: the fitted line prices every size)."""
    samples = rates.rank.profile.collective_sample
    reads = []
    for op, n, size in dict.fromkeys(plan_messages(model, plan)):
        sizes = {s.size_bytes for s in nearest_samples(samples, op, n, rates.rank.ranks)}
        if not sizes:
            continue
        shape = f"{op} of {size / MiB:.3g} MiB over {n}"
        largest = max(sizes)
        beyond = (f"size {size / MiB:.3g} > {largest / MiB:.3g} MiB",) if size > largest else ()
        reads.append(Read("collectives", shape, any(size == s for s in sizes), beyond))
    return reads


def _read(part: str, shape: tuple, tag: str, points: list, names: str) -> Read:
    measured = any(
        all(abs(a - b) <= 1e-9 * b for a, b in zip(shape, p, strict=True)) for p, _ in points
    )
    text = " x ".join(f"{x:g}" for x in shape) + (f" {tag}" if tag else "")
    return Read(part, text, measured, beyond_range(shape, points, names))


def _grouped_reads(rates: MeasuredRates, model: ModelSpec, plan: ParallelPlan, dtype: str) -> list:
    """The routed experts' passes: the nearest measured grouped shape of each layout (no
    interpolation), or, where the profile has no grouped rows, the per-expert GEMMs the
    rates time instead (`MeasuredRates.grouped_time_s`)."""
    rows = [r for r in rates.rank.profile.grouped_matmul if r.dtype == dtype]
    out = []
    for groups, tokens, n, k in dict.fromkeys(expert_projections(model, plan)):
        for layout, at in PASS_SHAPES.items():
            points = [((r.groups, r.tokens, r.n, r.k), 1.0) for r in rows if r.layout == layout]
            if points:
                shape = (groups, tokens, n, k)
                out.append(_read("grouped experts", shape, layout, points, "groups tokens n k"))
            else:
                gemm, _ = rates.gemm_points(dtype, layout)
                shape = tuple(max(1.0, x) for x in at(tokens / groups, n, k))
                out.append(_read("experts as GEMMs", shape, layout, gemm, "m n k"))
    return out


def device_model_line(est: Any) -> str:
    """`Coverage.describe` of an estimate's plan on its measured device; empty on a catalog
    GPU (`est`: an `estimate.Estimate`)."""
    rates = rates_for(est.cluster.device)
    if not isinstance(rates, MeasuredRates):
        return ""
    return coverage(rates, est.model, est.plan).describe()
