"""What each pipeline rank does after its last backward: the data-parallel gradient reduction,
the ZeRO-1/2 parameter all-gather, the optimizer step (with Muon's Newton-Schulz and its
whole-matrix gathers, `fivefold.planner.step_time.muon`) and offload's remaining host copies, each
exposed beyond the compute and idle time that can hide it (docs/planner.md, section 2, "DP /
ZeRO" and "Overlap limits").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from fivefold.planner.memory.model_states import fp8_gather_saving, layer_params_per_rank, params_of
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.chunk_costs import ChunkCosts
from fivefold.planner.step_time.comm import (
    TENSORS_PER_LAYER,
    Link,
    all_gather_bytes,
    all_gather_time_s,
    all_reduce_bytes,
    all_reduce_time_s,
    axis_groups,
    collective_count,
    group_link,
    issued_time_s,
    plan_link,
    reduce_scatter_time_s,
)
from fivefold.planner.step_time.layer_costs import collective_gap_s, fsdp_copy_s, per_layer_gathers
from fivefold.planner.step_time.lever_costs import offload_tail, optimizer_s
from fivefold.planner.step_time.muon import muon_cost
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import (
    chunk_rank,
    chunks_of_rank,
    dense_shard_degree,
    expert_shard_degree,
    is_v_shaped,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe


@dataclass(frozen=True)
class Tail:
    """What a pipeline rank does after its last backward: exposed seconds and the raw costs."""

    grad_exposed_s: float
    grad_time_s: float
    grad_bytes: float
    gather_exposed_s: float
    gather_time_s: float
    gather_bytes: float
    optimizer_s: float
    offload_exposed_s: float = 0.0  # PCIe copies outside the layers' gathers (`lever_costs`)
    offload_time_s: float = 0.0
    offload_bytes: float = 0.0

    @property
    def exposed_s(self) -> float:
        exposed = self.grad_exposed_s + self.gather_exposed_s + self.optimizer_s
        return exposed + self.offload_exposed_s


def rank_tails(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    chunk_sigs: list[tuple[int, int, bool, bool]],
    chunk_costs: list[ChunkCosts],
) -> list[Tail]:
    """The tail of every pipeline rank (this module's docstring). Ranks holding
    the same kind of chunks share the costs; only their drain idle time differs."""
    key = replace(plan, grad_accum=1, micro_batch=1, recompute="none", schedule="1f1b", vpp=1)
    pipelined = len(chunk_sigs) > 1
    loop = plan.pp > 1 and not is_v_shaped(plan.schedule, plan.pp)
    mean_backward = sum(c.backward_input_s + c.backward_weight_s for c in chunk_costs)
    mean_backward /= len(chunk_costs)
    mean_forward = sum(c.forward_s for c in chunk_costs) / len(chunk_costs)
    gap = collective_gap_s(model, plan, cluster, eff)
    shared: dict[tuple, tuple] = {}
    tails = []
    for rank in range(plan.pp):
        chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
        sig = tuple(chunk_sigs[c] for c in chunks)
        base = shared.get(sig)
        if base is None:
            params = [
                params_of(model, plan.tp, plan.ep, *chunk_sigs[c], pipelined, plan.etp)
                for c in chunks
            ]
            dense, experts = sum(p.dense for p in params), sum(p.experts for p in params)
            units = None
            if opts.runtime == "fivefold-eager":
                units = runtime_units(plan, [chunk_sigs[c] for c in chunks])
                if plan.ep == 1:  # the experts are reduced with their block
                    dense, experts = dense + experts, 0.0
            saving = sum(_fp8_saving(model, key, *chunk_sigs[c][:2]) for c in chunks)
            raw = tail_costs(model, key, cluster, eff, opts, dense, experts, units, gap, saving)
            if opts.optimizer == "muon":  # Newton-Schulz and its gathers join the step
                layers = (
                    sum(chunk_sigs[c][0] for c in chunks),
                    sum(chunk_sigs[c][1] for c in chunks),
                )
                raw = (*raw[:5], raw[5] + muon_cost(model, plan, cluster, eff, layers, gap).seconds)
            last_backward = sum(
                chunk_costs[c].backward_input_s + chunk_costs[c].backward_weight_s for c in chunks
            )
            first_forward = sum(chunk_costs[c].forward_s for c in chunks)
            opt_params = _optimizer_params(plan, dense, experts)
            base = shared[sig] = (raw, last_backward, first_forward, opt_params)
        raw, last_backward, first_forward, opt_params = base
        grad_time, grad_bytes, bucket_time, gather_time, gather_bytes, opt = raw
        # Overlap window: the rank's last micro-batch backward, and the time it idles while the
        # ranks before it finish their backwards (about `rank` chunk backwards in the loop
        # schedules; the V schedules end on every rank at nearly the same time).
        drain = rank * mean_backward if loop else 0.0
        window = last_backward + drain if opts.dp_overlap else 0.0
        grad_exposed = max(0.0, grad_time - window) + bucket_time if grad_time > 0 else 0.0
        # The parameter all-gather overlaps the next step's first forward and, symmetrically to
        # the drain, the warm-up time rank r waits for its first activation (r chunk forwards).
        warmup = rank * mean_forward if loop else 0.0
        gather_window = first_forward + warmup
        hidden = opts.dp_overlap and opts.param_gather_overlap
        gather_exposed = max(0.0, gather_time - gather_window) if hidden else gather_time
        offload = offload_tail(opt_params, plan, cluster, window)
        tied_time, tied_bytes = tied_embedding_sync(model, plan, cluster, eff, chunks)
        tails.append(
            Tail(
                grad_exposed + tied_time,
                grad_time + tied_time,
                grad_bytes + tied_bytes,
                gather_exposed,
                gather_time,
                gather_bytes,
                opt,
                *offload,
            )
        )
    return tails


def tied_embedding_sync(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    chunks: tuple[int, ...],
) -> tuple[float, float]:
    """(seconds, bytes per rank) of the all-reduce that sums a tied embedding's two copies'
    gradients between the first and the last pipeline stage, after the data-parallel reduction
    and exposed (`fivefold.parallel.tied_embeddings`): the rank's local shard of the [vocab,
    hidden] gradient (TP- and, under ZeRO, dp_shard x cp-sharded). (0, 0) on the middle stages,
    untied or unpipelined models, and the V schedules (both copies on one rank: summed there)."""
    last = plan.pp * plan.vpp - 1
    first_rank, last_rank = (
        chunk_rank(plan.schedule, plan.pp, 0),
        chunk_rank(plan.schedule, plan.pp, last),
    )
    if not model.tied_embeddings or first_rank == last_rank or not {0, last} & set(chunks):
        return 0.0, 0.0
    shard = plan.tp * (dense_shard_degree(plan) if plan.zero > 0 else 1)
    size = model.vocab * model.hidden / shard * recipe(plan.precision).grad_bytes
    stride = (last_rank - first_rank) * axis_groups(plan)["pp"][1]
    link = group_link(cluster, 2, stride, eff)
    return all_reduce_time_s(size, 2, link), all_reduce_bytes(size, 2)


def runtime_units(plan: ParallelPlan, sigs: list[tuple[int, int, bool, bool]]) -> tuple[int, int]:
    """(dense, expert) data-parallel units fivefold's runtime wraps on a rank holding chunks of
    signatures (dense layers, MoE layers, first, last): every block and every chunk's root
    (`fivefold.parallel.data_parallel.apply_data_parallel`), and under expert parallelism each
    MoE block's experts apart. Each unit reduces its gradients in one collective per step (or
    micro-batch) and gathers its parameters in one."""
    blocks = sum(n_dense + n_moe for n_dense, n_moe, _, _ in sigs)
    experts = sum(n_moe for _, n_moe, _, _ in sigs) if plan.ep > 1 else 0
    return blocks + len(sigs), experts


def _fp8_saving(model: ModelSpec, plan: ParallelPlan, n_dense: int, n_moe: int) -> float:
    """Gathered bytes FP8 all-gather saves for `n_dense` dense and `n_moe` MoE blocks."""
    dense = n_dense * fp8_gather_saving(model, plan, False)
    return dense + n_moe * fp8_gather_saving(model, plan, True)


def _optimizer_params(plan: ParallelPlan, dense: float, experts: float) -> float:
    """Parameters whose optimizer state a rank holds, of its `dense` and `experts` ones."""
    if plan.zero == 0:
        return dense + experts
    return dense / dense_shard_degree(plan) + experts / expert_shard_degree(plan)


@lru_cache(maxsize=65536)
def tail_costs(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    dense: float,
    experts: float,
    units: tuple[int, int] | None = None,
    gap: float | None = None,
    fp8_saving: float = 0.0,
) -> tuple[float, float, float, float, float, float]:
    """(gradient time, gradient bytes, last-bucket time, parameter all-gather time and bytes,
    optimizer step) for a rank holding `dense` and `experts` local parameters; `units`: the
    (dense, expert) units fivefold's runtime issues one collective each for (`runtime_units`),
    else the layers the parameters make up; `gap`: compute before each collective
    (`collective_gap_s`); `fp8_saving`: bytes the FP8 all-gather of the rank's converted
    linears saves (`_fp8_saving`)."""
    rec = recipe(plan.precision)
    s_dense, s_exp = dense_shard_degree(plan), expert_shard_degree(plan)
    groups = axis_groups(plan)
    grad_time = grad_bytes = gather_time = gather_bytes = bucket_time = 0.0
    for params, shard_group, shard, moe in (
        (dense, "dp_shard_cp", s_dense, False),
        (experts, "expert_shard", s_exp, True),
    ):
        if params == 0:
            continue
        lp = layer_params_per_rank(model, moe, plan.tp, plan.ep, plan.etp)
        layers = params / ((lp.experts if moe else lp.dense + lp.replicated) or params)
        if units is not None:
            layers = units[1] if moe else units[0]

        size = params * rec.grad_bytes
        n_shard = groups[shard_group][0]
        wrapped = opts.runtime == "fivefold-eager" and plan.world_size > 1
        if plan.zero == 0:  # plain all-reduce over every replica
            if shard_group == "dp_shard_cp":
                n, stride = groups["dp_cp"]
            else:
                n, stride = plan.dp_replicate * n_shard, groups["expert_shard"][1]
            if wrapped:  # FSDP2's replicate copies the gradients in and out, even alone
                grad_time += fsdp_copy_s(size, cluster.device, eff)
            if n > 1:
                link = group_link(cluster, n, stride, eff, gap)
                total, last = _issued(all_reduce_time_s, size, n, link, opts, layers)
                grad_time += total
                grad_bytes += all_reduce_bytes(size, n)
                bucket_time = max(bucket_time, last)
            continue
        once_per_step = plan.zero in (1, 2) or (plan.zero == 3 and not per_layer_gathers(plan))
        gsize = params * rec.param_bytes - (0.0 if moe else fp8_saving)
        if once_per_step and n_shard > 1:
            link = plan_link(cluster, plan, shard_group, eff, gap)
            total, last = _issued(reduce_scatter_time_s, size, n_shard, link, opts, layers)
            grad_time += total
            grad_bytes += all_gather_bytes(size, n_shard)
            bucket_time = max(bucket_time, last)
            gather_time += _issued(all_gather_time_s, gsize, n_shard, link, opts, layers)[0]
            gather_bytes += all_gather_bytes(gsize, n_shard)
        if once_per_step and wrapped:  # FSDP2's copies in and out, on a one-rank group too
            grad_time += fsdp_copy_s(size, cluster.device, eff)
            gather_time += fsdp_copy_s(gsize, cluster.device, eff)
        if plan.dp_replicate > 1:  # HSDP (zero 3) or replicas of ZeRO-1/2 shards
            link = plan_link(cluster, plan, "dp_replicate", eff, gap)
            shard_size = size / max(1, shard if plan.zero >= 2 else 1)
            total, last = _issued(
                all_reduce_time_s, shard_size, plan.dp_replicate, link, opts, layers
            )
            grad_time += total
            grad_bytes += all_reduce_bytes(shard_size, plan.dp_replicate)
            bucket_time = max(bucket_time, last)
    local = _optimizer_params(plan, dense, experts)
    opt = optimizer_s(local, plan, cluster, eff)
    return grad_time, grad_bytes, bucket_time, gather_time, gather_bytes, opt


def _issued(
    op, size: float, n: int, link: Link, opts: PlannerOptions, layers: float
) -> tuple[float, float]:
    """(time of every collective, time of the last one) moving `size` bytes of `layers` layers
    at the options' collective granularity (`comm.collective_count`)."""
    count = collective_count(
        size, opts.collective_granularity, opts.dp_bucket_bytes, layers, TENSORS_PER_LAYER
    )
    return issued_time_s(op, size, n, link, count), op(size / count, n, link)
