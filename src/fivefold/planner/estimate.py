"""`estimate()`: memory, step time, throughput and MFU of one parallel layout.

How a step is put together (each piece documented in its module):

1. The layers are split over the pp * vpp virtual stages (`partition.stage_layer_counts`).
2. Per virtual stage and micro-batch, the forward (F), input-gradient backward (B, with any
   recomputation) and weight-gradient backward (W) times are the compute time (`compute`) plus the
   communication that sits on the critical path inside the stage: tensor-parallel collectives
   (all of them, or with `tp_comm_overlap` one chunk per collective plus whatever the GEMMs cannot
   cover), context-parallel ring exchange beyond what block attention hides, expert all-to-alls,
   and ZeRO-3 layer gathers beyond what the previous layer's compute hides (`comm`).
3. The schedule's event simulation (`schedule.simulate`) runs those stage times with the
   point-to-point transfer between stages and gives the pipeline time, the bubble and the peak
   in-flight micro-batches per rank. Without pipelining the step is m * (F + B + W).
4. After the pipeline drains, each rank still has to finish its data-parallel gradient reduction
   (overlapped with its last micro-batch's backward and with the time the rank sits idle while
   earlier ranks drain: rank r of a 1F1B pipeline idles about r backward passes), the last bucket
   (never hidden), the ZeRO-1/2 parameter all-gather beyond the next step's first forward and
   the warm-up wait before it (rank r idles about r forward passes), and the optimizer step.
   The slowest rank sets the step time. fivefold's own runtime adds two scalar all-reduces
   per step (`runtime_sync_s`).
5. Memory per pipeline rank (`memory`) with the schedule's in-flight micro-batches.

MFU counts model FLOPs (no recompute, causal attention) against the dense peak of the recipe's
compute dtype; HFU adds recomputation. With `plan.fp8` the FLOPs of the FP8 linears count
against the FP8 peak and the rest against bf16 (`lever_costs.mfu_peak`). The memory levers add
their terms where they act (`lever_costs`): FP8 GEMMs and casts in the layer costs, "all"
offload's PCIe copies in the ZeRO-3 gathers and reduce-scatters, the host optimizer step and
the remaining PCIe copies in the tail (`offload_exposed_s`). Every user mistake raises
`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

from fivefold.errors import ConfigError
from fivefold.planner.comm import (
    TENSORS_PER_LAYER,
    Link,
    all_gather_bytes,
    all_gather_time_s,
    all_reduce_bytes,
    all_reduce_time_s,
    all_to_all_time_s,
    axis_groups,
    collective_count,
    deduplicated_dispatch_time_s,
    group_link,
    issued_time_s,
    link_model,
    p2p_time_s,
    pipeline_link,
    plan_link,
    reduce_scatter_time_s,
)
from fivefold.planner.compute import (
    Work,
    embedding_work,
    head_work,
    layer_work,
    memory_time_s,
)
from fivefold.planner.efficiency import EfficiencyModel, efficiency_model
from fivefold.planner.lever_costs import (
    fp8_layer_delta,
    mfu_peak,
    offload_layer_s,
    offload_tail,
    optimizer_s,
)
from fivefold.planner.levers import (
    HostMemory,
    host_memory,
    memory_plan,
    offloads,
)
from fivefold.planner.memory import StageMemory, all_stage_memory
from fivefold.planner.model_states import (
    chunk_layers,
    compute_bytes,
    fp8_gather_saving,
    layer_params_per_rank,
    local_kv_width,
    params_of,
)
from fivefold.planner.options import PlannerOptions
from fivefold.planner.partition import stage_layer_counts
from fivefold.planner.rates import rates_for
from fivefold.planner.schedule import Simulation, StageCosts, build_schedule, simulate
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.flops import training_flops_per_token
from fivefold.spec.geometry import (
    chunk_rank,
    chunks_of_rank,
    dense_shard_degree,
    expert_shard_degree,
    is_v_shaped,
)
from fivefold.spec.hardware import GPUSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import recipe
from fivefold.units import GiB

COMM_KINDS = ("tp", "cp", "ep", "zero-gather", "pp", "dp", "offload")


@dataclass(frozen=True)
class CommCost:
    """One kind of communication over a step, for the worst rank: bytes it sends, the time the
    transfers take, the part of that time on the critical path, and how the link was priced
    (`comm.link_model`, e.g. "p2p, slowest hop ib 45 GB/s per GPU")."""

    kind: str
    link: str
    bytes_per_step: float
    time_s: float
    exposed_s: float
    link_model: str = ""

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "link": self.link,
            "link_model": self.link_model,
            "bytes_per_step": self.bytes_per_step,
            "time_s": self.time_s,
            "exposed_s": self.exposed_s,
        }


@dataclass
class Estimate:
    """Everything the planner predicts for one layout. Times in seconds, memory in bytes."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    options: PlannerOptions
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    bubble_fraction: float  # busiest rank's idle / pipeline time = pipeline_bubble_s / that time
    memory: list[StageMemory]
    worst_stage: int
    hbm_bytes: float
    compute_time_s: float
    comm: list[CommCost]
    breakdown_s: dict[str, float]
    stage_costs: StageCosts
    layer_counts: list[int]
    peak_inflight: list[int]
    host_memory: HostMemory | None = None  # offloaded state against the node's host RAM
    _simulation: Simulation | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory[self.worst_stage].total <= self.hbm_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_memory is None or self.host_memory.fits

    @property
    def worst_memory(self) -> StageMemory:
        return self.memory[self.worst_stage]

    @property
    def peak_memory_bytes(self) -> float:
        return self.worst_memory.total

    def fits_with(self, headroom: float) -> bool:
        """True when the worst stage leaves `headroom` (a fraction of HBM) free."""
        return self.worst_memory.total <= (1.0 - headroom) * self.hbm_bytes

    @cached_property
    def simulation(self) -> Simulation:
        """The pipeline simulation (run on demand when the estimate skipped it, pp == 1)."""
        if self._simulation is not None:
            return self._simulation
        sched = build_schedule(
            _schedule_name(self.plan), self.plan.pp, self.plan.vpp, self.plan.grad_accum
        )
        return simulate(sched, self.stage_costs)

    def timeline(self) -> list[list[dict]]:
        return [
            [
                {
                    "kind": ev.kind,
                    "microbatch": ev.microbatch,
                    "chunk": ev.chunk,
                    "start_s": ev.start_s,
                    "end_s": ev.end_s,
                }
                for ev in rank
            ]
            for rank in self.simulation.events
        ]

    def to_json(self, timeline: bool = True) -> dict:
        """The stable JSON shape of `fivefold plan --json` (see the shared interfaces)."""
        return {
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_fraction": self.bubble_fraction,
            "memory_gib": self.worst_memory.gib(),
            "hbm_gib": self.hbm_bytes / GiB,
            "worst_stage": self.worst_stage,
            "memory_per_stage_gib": [m.gib() for m in self.memory],
            "other_gib": self.worst_memory.other_gib(),
            "compute_time_s": self.compute_time_s,
            "comm": [c.to_json() for c in self.comm],
            "breakdown_s": dict(self.breakdown_s),
            "layers_per_stage": list(self.layer_counts),
            "timeline": self.timeline() if timeline else [],
            "precision": self.plan.precision,
            "host_memory": self.host_memory.to_json() if self.host_memory else None,
            "plan": self.plan.to_dict(),
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
        }


def _schedule_name(plan: ParallelPlan) -> str:
    return plan.schedule if plan.pp > 1 else "1f1b"


# ---- per-layer costs, cached on what they depend on -------------------------------------------
@dataclass(frozen=True)
class LayerCosts:
    """Per layer per micro-batch on one rank: compute and the exposed in-stage communication."""

    work: Work
    tp_fwd_s: float  # exposed
    tp_bwd_s: float
    tp_time_s: float  # un-hidden transfer time fwd + bwd
    tp_bytes: float
    cp_fwd_s: float
    cp_bwd_s: float
    cp_time_s: float
    cp_bytes: float
    ep_fwd_s: float
    ep_bwd_s: float
    ep_bytes: float
    gather_s: float  # ZeRO-3: one gather of this layer's weights
    gather_bytes: float
    reduce_s: float  # ZeRO-3: one reduce-scatter of its gradients
    reduce_bytes: float
    gather_copy_s: float = 0.0  # ZeRO-3: copying one gather out into the parameters
    reduce_copy_s: float = 0.0  # ZeRO-3: copying the gradients into one reduce-scatter


@lru_cache(maxsize=4096)
def collective_gap_s(
    model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, eff: EfficiencyModel
) -> float | None:
    """Seconds a rank of `plan` computes before a typical collective, on a device measured by
    `fivefold calibrate` (None on a GPU cluster): half of one layer's forward at the
    micro-batch (tensor parallelism issues two collectives per layer forward, data parallelism
    one per layer backward, twice as long). The profile prices a collective after that much
    compute (`MeasuredRates.collective`: between its measured gaps, and as after the longest,
    its model's MLP GEMM, beyond it; `DeviceRates.collective_gap_s`)."""
    device = cluster.device
    key = replace(plan, recompute="none", fp8="none")
    moe = model.is_moe and not model.dense_layers
    return rates_for(device, eff).collective_gap_s(
        lambda: layer_work(model, key, device, eff, moe).forward_s
    )


def per_layer_gathers(plan: ParallelPlan) -> bool:
    """Whether ZeRO-3 gathers each layer's weights per micro-batch (forward and backward).
    Under pipelining it does not: torch's pipeline stages keep an FSDP chunk gathered from its
    first forward to the end of the step and reduce-scatter its gradients after the last
    backward (`fivefold.parallel.pipeline`), so ZeRO-3 x PP communicates as ZeRO-1 does, once
    per step (`_tail_costs`)."""
    return plan.zero == 3 and plan.pp == 1


def _layer_key(plan: ParallelPlan) -> ParallelPlan:
    """The plan fields a layer's cost depends on (others reset, for the cache)."""
    return ParallelPlan(
        tp=plan.tp,
        sp=plan.sp,
        cp=plan.cp,
        cp_kind=plan.cp_kind,
        ep=plan.ep,
        dp_shard=plan.dp_shard,
        zero=3 if per_layer_gathers(plan) else 0,
        micro_batch=plan.micro_batch,
        recompute=plan.recompute,
        precision=plan.precision,
        offload="all" if plan.offload == "all" else "none",
        fp8=plan.fp8,
    )


@lru_cache(maxsize=65536)
def _layer_costs(
    model: ModelSpec,
    key: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    moe: bool,
) -> LayerCosts:
    device = cluster.device
    work = layer_work(model, key, device, eff, moe, opts.compute())
    if key.fp8 != "none":
        work = work + fp8_layer_delta(model, key, device, eff, moe, opts.selective_policy)
    e = recipe(key.precision).activation_bytes
    tokens = key.micro_batch * model.seq_len / key.cp
    t = key.tp
    gap = collective_gap_s(model, key, cluster, eff)
    # Tensor parallelism: 2 collectives forward, 2 backward, 2 more with full recompute.
    tp_fwd = tp_bwd = tp_time = tp_bytes = 0.0
    if t > 1:
        link = plan_link(cluster, key, "tp", eff, gap)
        size = tokens * model.hidden * e
        if key.sp:
            one = 2 * all_gather_time_s(size, t, link)  # an all-gather and a reduce-scatter
            sent = 2 * all_gather_bytes(size, t)
        else:
            one = all_reduce_time_s(size, t, link)
            sent = all_reduce_bytes(size, t)
        n_fwd = 2
        n_bwd = 2 + (2 if key.recompute == "full" else 0)
        fwd, bwd = n_fwd * one, n_bwd * one
        tp_time, tp_bytes = fwd + bwd, (n_fwd + n_bwd) * sent
        if opts.tp_comm_overlap:
            gemm = work.gemm_forward_s
            tp_fwd = fwd / t + max(0.0, fwd - gemm)
            tp_bwd = bwd / t + max(0.0, bwd - 2 * gemm)
        else:
            tp_fwd, tp_bwd = fwd, bwd
    # Context parallelism.
    cp_fwd = cp_bwd = cp_time = cp_bytes = 0.0
    if key.cp > 1:
        cp_fwd, cp_bwd, cp_time, cp_bytes = _cp_costs(
            model, key, cluster, eff, work, e, tokens, gap, opts.runtime == "fivefold-eager"
        )
    # Expert parallelism: dispatch and combine all-to-alls, forward and backward.
    ep_fwd = ep_bwd = ep_bytes = 0.0
    if moe and key.ep > 1:
        link = plan_link(cluster, key, "ep", eff, gap)
        size = tokens * model.top_k * model.hidden * e
        if opts.ep_dispatch == "deepep":
            one = deduplicated_dispatch_time_s(size / model.top_k, model.top_k, key.ep, link)
        else:
            one = all_to_all_time_s(size, key.ep, link)
        ep_fwd = 2 * one
        ep_bwd = ep_fwd * (2 if key.recompute == "full" else 1)
        ep_bytes = (2 + 2 + (2 if key.recompute == "full" else 0)) * size * (key.ep - 1) / key.ep
    # ZeRO-3 per-layer gather and reduce-scatter.
    gather = gather_bytes = reduce = reduce_bytes = gather_copy = reduce_copy = 0.0
    if key.zero == 3:
        rec = recipe(key.precision)
        lp = layer_params_per_rank(model, moe, t, key.ep)
        for params, group in (
            (lp.dense + lp.replicated, "dp_shard_cp"),
            (lp.experts, "expert_shard"),
        ):
            n = axis_groups(key)[group][0]
            if n <= 1 or params == 0:
                continue
            link = plan_link(cluster, key, group, eff, gap)
            # FSDP gathers a wrapped layer at once; per-parameter hooks issue one per tensor.
            count = TENSORS_PER_LAYER if opts.collective_granularity == "parameter" else 1
            size = params * compute_bytes(rec)
            if group == "dp_shard_cp":  # FP8 all-gather of the converted linears
                size -= fp8_gather_saving(model, key)
            gather += issued_time_s(all_gather_time_s, size, n, link, count)
            gather_bytes += all_gather_bytes(size, n)
            size = params * rec.grad_bytes
            reduce += issued_time_s(reduce_scatter_time_s, size, n, link, count)
            reduce_bytes += all_gather_bytes(size, n)
            if offloads(key, device):  # each shard crosses PCIe around its collective
                h2d, d2h = offload_layer_s(params / n, key, device)
                gather, reduce = gather + h2d, reduce + d2h
            if opts.runtime == "fivefold-eager":  # FSDP2 copies; flat-buffer frameworks do not
                gather_copy += fsdp_copy_s(params * compute_bytes(rec), cluster.device, eff)
                reduce_copy += fsdp_copy_s(params * rec.grad_bytes, cluster.device, eff)
    return LayerCosts(
        work,
        tp_fwd,
        tp_bwd,
        tp_time,
        tp_bytes,
        cp_fwd,
        cp_bwd,
        cp_time,
        cp_bytes,
        ep_fwd,
        ep_bwd,
        ep_bytes,
        gather,
        gather_bytes,
        reduce,
        reduce_bytes,
        gather_copy,
        reduce_copy,
    )


def dtensor_small_collectives_s(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    layers: int,
    last: bool,
) -> tuple[float, float]:
    """(forward, backward) seconds of the latency-bound collectives DTensor tensor parallelism
    adds per micro-batch in fivefold's runtime: with sequence parallelism each norm weight's
    gradient is a partial sum all-reduced over the TP group in the backward (two per layer, the
    final norm on the last stage), and the vocabulary-parallel loss all-reduces the row
    maximum, the sum of exponentials and the target logit (fp32, one per token) forward."""
    link = plan_link(cluster, plan, "tp", eff, collective_gap_s(model, plan, cluster, eff))
    backward = 0.0
    if plan.sp:
        norm = all_reduce_time_s(model.hidden * recipe(plan.precision).grad_bytes, plan.tp, link)
        backward = (2 * layers + (1 if last else 0)) * norm
    forward = 0.0
    if last:
        tokens = plan.micro_batch * model.seq_len / plan.cp
        forward = 3 * all_reduce_time_s(tokens * 4.0, plan.tp, link)
    return forward, backward


def routing_sync_s(
    model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, eff: EfficiencyModel
) -> float:
    """Seconds of the small collectives fivefold's runtime adds to a MoE layer's forward, per
    micro-batch: the load-balancing statistics (per-expert counts and probability sums, fp64)
    all-reduced over the ranks that see different tokens, and with expert parallelism the
    per-expert token counts exchanged (an all-to-all of int64) before the dispatch; both
    latency-bound, on the pipeline's critical path (`estimate` adds them to the stage costs)."""
    n = axis_groups(plan)["dp_cp"][0]
    gap = collective_gap_s(model, plan, cluster, eff)
    total = 0.0
    if n > 1:
        stats = (2 * model.experts + 2) * 8.0
        total += all_reduce_time_s(stats, n, plan_link(cluster, plan, "dp_cp", eff, gap))
    if plan.ep > 1:
        counts = model.experts * 8.0
        total += all_to_all_time_s(counts, plan.ep, plan_link(cluster, plan, "ep", eff, gap))
    return total


def fsdp_copy_s(size_bytes: float, device: GPUSpec, eff: EfficiencyModel) -> float:
    """Seconds FSDP2 spends copying `size_bytes` of unsharded tensors around one collective:
    an all-gather's output is copied out into the parameters, the gradients are copied into a
    reduce-scatter's input (read and write each byte once), memory-bound (`memory_time_s`).
    Counted for fivefold's runtime (FSDP2 for every ZeRO stage); frameworks that gather into
    and reduce from flat parameter and gradient buffers (Megatron) have no such copies."""
    return memory_time_s(2 * size_bytes, device, eff)


def _cp_costs(
    model,
    key,
    cluster,
    eff,
    work: Work,
    e: int,
    tokens: float,
    gap: float | None,
    eager: bool = False,
):
    """(exposed fwd, exposed bwd, transfer time, bytes) of context parallelism for one layer
    (`gap`: compute before each collective, `collective_gap_s`; `eager`: fivefold's own ring,
    `_ring_costs`)."""
    cp = key.cp
    link = plan_link(cluster, key, "cp", eff, gap)
    kv_block = tokens * 2 * local_kv_width(model, key.tp) * e
    if key.cp_kind == "ring" and eager:
        return _ring_costs(key, work, kv_block, e, link)
    if key.cp_kind == "ring":
        step_f = p2p_time_s(kv_block, link)
        step_b = p2p_time_s(2 * kv_block, link)  # K, V and their gradients travel back
        fwd = (cp - 1) * max(0.0, step_f - work.attention_forward_s / cp)
        bwd = (cp - 1) * max(0.0, step_b - work.attention_backward_s / cp)
        if key.recompute == "full":
            bwd += fwd
        return fwd, bwd, (cp - 1) * (step_f + step_b), (cp - 1) * 3 * kv_block
    if key.cp_kind == "allgather":
        gathered = kv_block * cp
        fwd = all_gather_time_s(gathered, cp, link)
        bwd = reduce_scatter_time_s(gathered, cp, link) + (fwd if key.recompute == "full" else 0)
        return fwd, bwd, fwd + bwd, 2 * all_gather_bytes(gathered, cp)
    # Ulysses: all-to-all q, k, v in and the output back, forward and backward.
    width = model.q_width / key.tp * 2 + 2 * local_kv_width(model, key.tp)
    size = tokens * width * e
    fwd = all_to_all_time_s(size, cp, link)
    bwd = fwd * (2 if key.recompute == "full" else 1)
    return fwd, bwd, fwd + bwd, 2 * size * (cp - 1) / cp


def _ring_costs(key: ParallelPlan, work: Work, kv_block: float, e: int, link: Link):
    """(exposed fwd, exposed bwd, transfer time, bytes) of fivefold's ring attention for one
    layer (`fivefold.parallel.context_parallel._RingAttention`): forward, cp - 1 exchanges of a
    K/V block; backward, the K/V ring again (cp - 1) and cp exchanges of the block's fp32
    dK/dV (the last hop brings a rank's own block home). Each exchange hides behind the block
    attention computed meanwhile, except on a CPU, where the transport needs the cores that
    compute: there all of it is exposed."""
    cp = key.cp
    grads = kv_block * 4 / e
    kv_f = (cp - 1) * p2p_time_s(kv_block, link)
    kv_b = kv_f + cp * p2p_time_s(grads, link)
    hidden = link.hides_transfers
    fwd = max(0.0, kv_f - work.attention_forward_s * (cp - 1) / cp) if hidden else kv_f
    bwd = max(0.0, kv_b - work.attention_backward_s) if hidden else kv_b
    if key.recompute == "full":
        bwd += fwd
    return fwd, bwd, kv_f + kv_b, 2 * (cp - 1) * kv_block + cp * grads


# ---- chunk (virtual stage) costs ---------------------------------------------------------------
@dataclass(frozen=True)
class ChunkCosts:
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    compute_s: float  # compute part of F + B + W
    tp: tuple[float, float, float]  # exposed, time, bytes (per micro-batch)
    cp: tuple[float, float, float]
    ep: tuple[float, float, float]
    zero: tuple[float, float, float]  # ZeRO-3 parameter gathers
    zero_rs: tuple[float, float, float]  # ZeRO-3 gradient reduce-scatters


@lru_cache(maxsize=65536)
def _chunk_costs_of(
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
    """Costs of a virtual stage with `n_dense` + `n_moe` layers (plan = `_layer_key(plan)`)."""
    key = plan
    f = b = w = compute = 0.0
    tp = [0.0, 0.0, 0.0]
    cp = [0.0, 0.0, 0.0]
    ep = [0.0, 0.0, 0.0]
    zero = [0.0, 0.0, 0.0]
    zero_rs = [0.0, 0.0, 0.0]
    for n, moe in ((n_dense, False), (n_moe, True)):
        if n == 0:
            continue
        lc = _layer_costs(model, key, cluster, eff, opts, moe)
        wk = lc.work
        f += n * (wk.forward_s + lc.tp_fwd_s + lc.cp_fwd_s + lc.ep_fwd_s)
        b += n * (wk.backward_input_s + lc.tp_bwd_s + lc.cp_bwd_s + lc.ep_bwd_s)
        w += n * wk.backward_weight_s
        compute += n * wk.total_s
        tp = [
            tp[0] + n * (lc.tp_fwd_s + lc.tp_bwd_s),
            tp[1] + n * lc.tp_time_s,
            tp[2] + n * lc.tp_bytes,
        ]
        cp = [
            cp[0] + n * (lc.cp_fwd_s + lc.cp_bwd_s),
            cp[1] + n * lc.cp_time_s,
            cp[2] + n * lc.cp_bytes,
        ]
        ep_time = lc.ep_fwd_s + lc.ep_bwd_s
        ep = [ep[0] + n * ep_time, ep[1] + n * ep_time, ep[2] + n * lc.ep_bytes]
        if plan.zero == 3 and lc.gather_s > 0:
            # Each layer's gather hides behind the previous layer's compute; the first does not.
            # Each layer's gather hides behind the previous layer's compute, its gradient
            # reduce-scatter behind the next layer's backward; the first gather and the last
            # reduce-scatter of the chunk cannot hide.
            # Without dp_overlap (a CPU: collectives take the cores' time) nothing hides.
            hide_f = wk.forward_s if opts.dp_overlap else 0.0
            hide_b = wk.backward_input_s + wk.backward_weight_s if opts.dp_overlap else 0.0
            exposed_f = n * max(0.0, lc.gather_s - hide_f) + lc.gather_s
            exposed_b = n * max(0.0, lc.gather_s + lc.reduce_s - hide_b)
            f += exposed_f + n * lc.gather_copy_s
            b += exposed_b + lc.reduce_s + n * (lc.gather_copy_s + lc.reduce_copy_s)
            compute += n * (2 * lc.gather_copy_s + lc.reduce_copy_s)
            gather_share = lc.gather_s / (lc.gather_s + lc.reduce_s)
            zero = [
                zero[0] + exposed_f + exposed_b * gather_share,
                zero[1] + 2 * n * lc.gather_s,
                zero[2] + 2 * n * lc.gather_bytes,
            ]
            zero_rs = [
                zero_rs[0] + exposed_b * (1 - gather_share) + lc.reduce_s,
                zero_rs[1] + n * lc.reduce_s,
                zero_rs[2] + n * lc.reduce_bytes,
            ]
    device = cluster.device
    ends = ([embedding_work(model, plan, device, eff)] if first else []) + (
        [head_work(model, plan, device, eff)] if last else []
    )
    for hw in ends:
        f += hw.forward_s
        b += hw.backward_input_s
        w += hw.backward_weight_s
        compute += hw.total_s
    if plan.tp > 1 and (first or last):
        # The embedding's (and the head's) entry into / exit from the sequence-parallel region.
        link = plan_link(cluster, plan, "tp", eff, collective_gap_s(model, plan, cluster, eff))
        size = (
            plan.micro_batch
            * model.seq_len
            / plan.cp
            * model.hidden
            * recipe(plan.precision).activation_bytes
        )
        one = (
            all_gather_time_s(size, plan.tp, link)
            if plan.sp
            else all_reduce_time_s(size, plan.tp, link)
        )
        f += one
        b += one if last else 0.0
        extra = one * (2 if last else 1)
        tp = [tp[0] + extra, tp[1] + extra, tp[2] + size]
    if plan.tp > 1 and opts.runtime == "fivefold-eager":
        small_f, small_b = dtensor_small_collectives_s(
            model, plan, cluster, eff, n_dense + n_moe, last
        )
        f, b = f + small_f, b + small_b
        tp = [tp[0] + small_f + small_b, tp[1] + small_f + small_b, tp[2]]
    return ChunkCosts(
        f, b, w, compute, tuple(tp), tuple(cp), tuple(ep), tuple(zero), tuple(zero_rs)
    )


# ---- data-parallel tail ------------------------------------------------------------------------
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


def _rank_tails(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    chunk_sigs: list[tuple[int, int, bool, bool]],
    chunk_costs: list[ChunkCosts],
) -> list[Tail]:
    """The data-parallel tail of every pipeline rank (module docstring, step 4). Ranks holding
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
            params = [params_of(model, plan.tp, plan.ep, *chunk_sigs[c], pipelined) for c in chunks]
            dense, experts = sum(p.dense for p in params), sum(p.experts for p in params)
            units = None
            if opts.runtime == "fivefold-eager":
                units = runtime_units(plan, [chunk_sigs[c] for c in chunks])
                if plan.ep == 1:  # the experts are reduced with their block
                    dense, experts = dense + experts, 0.0
            raw = _tail_costs(model, key, cluster, eff, opts, dense, experts, units, gap)
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
        tails.append(
            Tail(
                grad_exposed,
                grad_time,
                grad_bytes,
                gather_exposed,
                gather_time,
                gather_bytes,
                opt,
                *offload,
            )
        )
    return tails


def runtime_units(plan: ParallelPlan, sigs: list[tuple[int, int, bool, bool]]) -> tuple[int, int]:
    """(dense, expert) data-parallel units fivefold's runtime wraps on a rank holding chunks of
    signatures (dense layers, MoE layers, first, last): every block and every chunk's root
    (`fivefold.parallel.data_parallel.apply_data_parallel`), and under expert parallelism each
    MoE block's experts apart. Each unit reduces its gradients in one collective per step (or
    micro-batch) and gathers its parameters in one."""
    blocks = sum(n_dense + n_moe for n_dense, n_moe, _, _ in sigs)
    experts = sum(n_moe for _, n_moe, _, _ in sigs) if plan.ep > 1 else 0
    return blocks + len(sigs), experts


def _optimizer_params(plan: ParallelPlan, dense: float, experts: float) -> float:
    """Parameters whose optimizer state a rank holds, of its `dense` and `experts` ones."""
    if plan.zero == 0:
        return dense + experts
    return dense / dense_shard_degree(plan) + experts / expert_shard_degree(plan)


@lru_cache(maxsize=65536)
def _tail_costs(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    dense: float,
    experts: float,
    units: tuple[int, int] | None = None,
    gap: float | None = None,
) -> tuple[float, float, float, float, float, float]:
    """(gradient time, gradient bytes, last-bucket time, parameter all-gather time and bytes,
    optimizer step) for a rank holding `dense` and `experts` local parameters; `units`: the
    (dense, expert) units fivefold's runtime issues one collective each for (`runtime_units`),
    else the layers the parameters make up; `gap`: compute before each collective
    (`collective_gap_s`)."""
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
        lp = layer_params_per_rank(model, moe, plan.tp, plan.ep)
        layers = params / ((lp.experts if moe else lp.dense + lp.replicated) or params)
        if units is not None:
            layers = units[1] if moe else units[0]

        size = params * rec.grad_bytes
        n_shard = groups[shard_group][0]
        if plan.zero == 0:  # plain all-reduce over every replica
            if shard_group == "dp_shard_cp":
                n, stride = groups["dp_cp"]
            else:
                n, stride = plan.dp_replicate * n_shard, groups["expert_shard"][1]
            if n > 1:
                link = group_link(cluster, n, stride, eff, gap)
                total, last = _issued(all_reduce_time_s, size, n, link, opts, layers)
                grad_time += total
                grad_bytes += all_reduce_bytes(size, n)
                bucket_time = max(bucket_time, last)
            continue
        once_per_step = plan.zero in (1, 2) or (plan.zero == 3 and not per_layer_gathers(plan))
        if once_per_step and n_shard > 1:
            link = plan_link(cluster, plan, shard_group, eff, gap)
            total, last = _issued(reduce_scatter_time_s, size, n_shard, link, opts, layers)
            grad_time += total
            if opts.runtime == "fivefold-eager":
                grad_time += fsdp_copy_s(size, cluster.device, eff)
            grad_bytes += all_gather_bytes(size, n_shard)
            bucket_time = max(bucket_time, last)
            gsize = params * rec.param_bytes
            gather_time += _issued(all_gather_time_s, gsize, n_shard, link, opts, layers)[0]
            if opts.runtime == "fivefold-eager":
                gather_time += fsdp_copy_s(gsize, cluster.device, eff)
            gather_bytes += all_gather_bytes(gsize, n_shard)
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


# ---- the estimate ------------------------------------------------------------------------------
def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    options: PlannerOptions | None = None,
    efficiency: EfficiencyModel | None = None,
    pipeline: str = "simulate",
    *,
    runtime: bool = True,
) -> Estimate:
    """Predict memory, step time, tokens/s, MFU and HFU of `plan` for `model` on `cluster`.

    `pipeline="simulate"` runs the schedule's event simulation (exact for the stage costs, a few
    ms for deep pipelines with many micro-batches); `"analytic"` uses the closed forms
    generalised to unequal stages (`analytic_pipeline`), microseconds, for searches that
    simulate only their finalists. Raises `ConfigError` listing every problem when the plan is
    invalid for them. `runtime=False` drops the rules of fivefold's own runtime
    (`ParallelPlan.problems`), for runs made by other software such as the published ones.
    """
    opts = options or PlannerOptions.for_device(cluster.device)
    eff = efficiency or efficiency_model()
    if pipeline not in ("simulate", "analytic"):
        raise ConfigError(f"pipeline = {pipeline!r}: choose 'simulate' or 'analytic'.")
    _validate(model, cluster, plan, opts, runtime)
    device = cluster.device
    counts = stage_layer_counts(model, plan.pp * plan.vpp)
    key = _layer_key(plan)
    last = len(counts) - 1
    chunk_sigs = [(*chunk_layers(model, counts, c), c == 0, c == last) for c in range(last + 1)]
    chunk_costs = [_chunk_costs_of(model, key, cluster, eff, opts, *sig) for sig in chunk_sigs]
    m = plan.grad_accum
    tokens = plan.micro_batch * model.seq_len / plan.cp
    e = recipe(plan.precision).activation_bytes
    boundary = tokens * model.hidden * e / (plan.tp if plan.sp and plan.tp > 1 else 1)
    gap = collective_gap_s(model, plan, cluster, eff)
    pp_link = pipeline_link(cluster, plan, eff, gap)
    p2p = p2p_time_s(boundary, pp_link) if plan.pp > 1 else 0.0
    routing = 0.0
    if model.is_moe and opts.runtime == "fivefold-eager":
        routing = routing_sync_s(model, plan, cluster, eff)
    rerun = 1.0 if plan.recompute == "full" else 0.0  # full recompute re-runs the forward's
    pairs = list(zip(chunk_costs, chunk_sigs, strict=True))
    costs = StageCosts(
        tuple(c.forward_s + sig[1] * routing for c, sig in pairs),
        tuple(c.backward_input_s + rerun * sig[1] * routing for c, sig in pairs),
        tuple(c.backward_weight_s for c in chunk_costs),
        p2p,
    )
    sim: Simulation | None = None
    if plan.pp == 1:
        pipeline_s = m * (
            costs.forward_s[0] + costs.backward_input_s[0] + costs.backward_weight_s[0]
        )
        inflight = [1]
        busy = [pipeline_s]
    else:
        sched = build_schedule(plan.schedule, plan.pp, plan.vpp, m)
        inflight = list(sched.peak_inflight)
        if pipeline == "simulate":
            sim = simulate(sched, costs)
            pipeline_s, busy = sim.step_time_s, list(sim.busy_s)
        else:
            pipeline_s, busy = analytic_pipeline(plan, costs)
    tails = _rank_tails(model, plan, cluster, eff, opts, chunk_sigs, chunk_costs)
    sync = runtime_sync_s(plan, cluster, eff, opts, gap)
    step = pipeline_s + max(t.exposed_s for t in tails) + sync
    memory = all_stage_memory(model, memory_plan(plan, device), inflight, opts.memory())
    worst = max(range(plan.pp), key=lambda r: memory[r].total)
    host = None
    if offloads(plan, device):
        per_gpu = max(mem.host_bytes for mem in memory)
        host = host_memory(per_gpu, cluster.gpus_per_node, cluster.gpu, device)
    global_tokens = plan.global_batch * model.seq_len
    peak = mfu_peak(model, plan, device) * cluster.world_size
    model_flops = training_flops_per_token(model, model.seq_len, "none") * global_tokens
    hw_flops = training_flops_per_token(
        model, model.seq_len, plan.recompute, early_stop=opts.checkpoint_early_stop
    )
    hw_flops *= global_tokens
    placed = [chunks_of_rank(plan.schedule, plan.pp, plan.vpp, r) for r in range(plan.pp)]
    rank_compute = [m * sum(chunk_costs[c].compute_s for c in chunks) for chunks in placed]
    busiest = max(range(plan.pp), key=lambda r: busy[r])
    in_stage = _excess(busy[busiest], rank_compute[busiest])
    shared = shared_cores_step_s(plan, device, rank_compute, in_stage, step - pipeline_s)
    core_sharing = min(0.0, shared - step)
    step += core_sharing
    # The step pays the busiest rank's idle time; the fraction and the seconds are that one figure.
    bubble_s = _excess(pipeline_s, busy[busiest])
    bubble = bubble_s / pipeline_s if pipeline_s > 0 else 0.0
    comm = _comm_summary(
        plan, cluster, eff, opts, chunk_costs, tails, busiest, m, p2p, boundary, pp_link
    )
    slowest_tail = max(tails, key=lambda t: t.exposed_s)
    breakdown = {
        "compute_s": rank_compute[busiest],
        "in_stage_comm_s": in_stage,
        "pipeline_bubble_s": bubble_s,
        "dp_grad_exposed_s": slowest_tail.grad_exposed_s,
        "param_gather_exposed_s": slowest_tail.gather_exposed_s,
        "optimizer_s": slowest_tail.optimizer_s,
        "offload_exposed_s": slowest_tail.offload_exposed_s,
        "runtime_sync_s": sync,
        "core_sharing_s": core_sharing,
    }
    return Estimate(
        model=model,
        cluster=cluster,
        plan=plan,
        options=opts,
        step_time_s=step,
        tokens_per_s=global_tokens / step,
        mfu=model_flops / (step * peak),
        hfu=hw_flops / (step * peak),
        bubble_fraction=bubble,
        memory=memory,
        worst_stage=worst,
        hbm_bytes=float(device.hbm_bytes),
        compute_time_s=max(rank_compute),
        comm=comm,
        breakdown_s=breakdown,
        stage_costs=costs,
        layer_counts=counts,
        peak_inflight=inflight,
        host_memory=host,
        _simulation=sim,
    )


def shared_cores_step_s(
    plan: ParallelPlan,
    device: GPUSpec,
    rank_compute: list[float],
    in_stage_s: float,
    after_s: float,
) -> float:
    """On a CPU whose ranks outnumber its cores (a measured device with a core share below
    one), the step when the cores never idle (infinite elsewhere; `estimate` takes the smaller
    of this and its pipeline's step). The shared rates assume every rank computes all the
    time, but a rank waiting for a pipeline neighbour sleeps and leaves its core to the others:
    so every rank's compute at full speed, over the cores; plus the busiest rank's in-stage
    collectives (`in_stage_s`, priced among as many processes as cores: the share of it that
    is transfer, not waiting for a peer's core, which the compute term already counts); plus
    `after_s`, what all ranks do together after the pipeline (gradient reduction, the
    runtime's synchronisations). `rank_compute`: each pipeline rank's compute at the shared
    rates, seconds (`DeviceRates.shared_cores_step_s`)."""
    ranks_per_stage = plan.world_size // plan.pp
    return rates_for(device).shared_cores_step_s(ranks_per_stage, rank_compute, in_stage_s, after_s)


def _excess(total_s: float, part_s: float) -> float:
    """`total_s - part_s` when it exceeds float residue (1e-9 relative), else 0."""
    excess = total_s - part_s
    return 0.0 if excess <= 1e-9 * max(abs(total_s), abs(part_s)) else excess


def runtime_sync_s(
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    gap: float | None = None,
) -> float:
    """fivefold's runtime (`opts.runtime == "fivefold-eager"`) adds two scalar all-reduces to
    every step: the global token count over the data-parallel ranks before the first forward
    (the loss scale) and the loss mean over the world after the last backward; each costs a
    collective's latency and nothing hides it."""
    if opts.runtime != "fivefold-eager":
        return 0.0
    total = 0.0
    for n, size in ((plan.dp, 8.0), (plan.world_size, 16.0)):
        if n > 1:
            total += all_reduce_time_s(size, n, group_link(cluster, n, 1, eff, gap))
    return total


def analytic_pipeline(plan: ParallelPlan, costs: StageCosts) -> tuple[float, list[float]]:
    """(step seconds, busy seconds per rank) of the pipeline from closed forms.

    With T_r the per-micro-batch work of rank r (F + B + W over its chunks), m micro-batches,
    p ranks, v chunks per rank and the point-to-point time d:
      GPipe, 1F1B:       (m - 1) max T_r + sum_r T_r + 2 (p - 1) d   (uniform: (m + p - 1) T)
      interleaved 1F1B:  m max T_r + (p - 1) mean T_r / v + 2 (p v - 1) d
                         (uniform: ideal * (1 + (p - 1)/(v m)), Narayanan et al. 2021)
      ZBV, DualPipeV:    m max T_r + (p - 1) max(0, F + B - 2 W) + 2 (2p - 1) d, with F, B, W the
                         mean chunk times (the zero-bubble V schedule's bubble, Qi et al. 2024)
    """
    m, p, v = plan.grad_accum, plan.pp, plan.vpp
    work = [0.0] * p
    for chunk in range(p * v):
        rank = chunk_rank(plan.schedule, plan.pp, chunk)
        work[rank] += (
            costs.forward_s[chunk] + costs.backward_input_s[chunk] + costs.backward_weight_s[chunk]
        )
    busy = [m * w for w in work]
    d = costs.p2p_s
    if plan.schedule in ("gpipe", "1f1b"):
        return (m - 1) * max(work) + sum(work) + 2 * (p - 1) * d, busy
    if plan.schedule == "interleaved-1f1b":
        mean = sum(work) / p
        return m * max(work) + (p - 1) * mean / v + 2 * (p * v - 1) * d, busy
    n = p * v
    f = sum(costs.forward_s) / n
    b = sum(costs.backward_input_s) / n
    w = sum(costs.backward_weight_s) / n
    return m * max(work) + (p - 1) * max(0.0, f + b - 2 * w) + 2 * (n - 1) * d, busy


def _validate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    opts: PlannerOptions,
    runtime: bool = True,
) -> None:
    plan.validate(model, cluster, runtime=runtime)
    opts.validate()
    device: GPUSpec = cluster.device
    device.peak(recipe(plan.precision).compute_dtype)  # "unknown peak" for e.g. the CPU
    if plan.fp8 != "none":
        device.peak("fp8")  # FP8 compute needs an FP8 peak (not on an A100)
    rates_for(device).check_offload(plan, cluster)  # the host RAM and bandwidth offload needs
    if device.hbm_bytes <= 0 or device.hbm_bw_bytes_per_s <= 0:
        raise ConfigError(
            f"cluster.gpu = {cluster.gpu!r} has no HBM capacity or bandwidth in the catalog; "
            "the planner needs a GPU from the catalog (fivefold.spec.hardware)."
        )


def _comm_summary(
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    chunk_costs: list[ChunkCosts],
    tails: list[Tail],
    rank: int,
    m: int,
    p2p: float,
    boundary: float,
    pp_link: Link,
) -> list[CommCost]:
    chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
    out: list[CommCost] = []
    cp_pattern = {"ring": "p2p", "allgather": "collective"}.get(plan.cp_kind, "all-to-all")
    ep_pattern = "dispatch" if opts.ep_dispatch == "deepep" else "all-to-all"

    def add(
        kind: str, group: str, triple: tuple[float, float, float], pattern: str = "collective"
    ) -> None:
        exposed, time, sent = triple
        if time <= 0 and sent <= 0:
            return
        link = plan_link(cluster, plan, group, eff)
        words = link_model(link, pattern, axis_groups(plan)[group][0])
        out.append(CommCost(kind, link.kind, sent, time, exposed, words))

    def total(attr: str) -> tuple[float, float, float]:
        parts = [getattr(chunk_costs[c], attr) for c in chunks]
        return tuple(m * sum(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]

    add("tp", "tp", total("tp"))
    add("cp", "cp", total("cp"), cp_pattern)
    add("ep", "ep", total("ep"), ep_pattern)
    tail = tails[rank]
    zero = total("zero")
    zero_gather = (
        zero[0] + tail.gather_exposed_s,
        zero[1] + tail.gather_time_s,
        zero[2] + tail.gather_bytes,
    )
    add("zero-gather", "dp_shard_cp", zero_gather)
    if plan.pp > 1:
        hops = 2 * m * plan.vpp
        critical = 2 * (plan.pp * plan.vpp - 1) * p2p
        words = link_model(pp_link, "p2p", 2)
        out.append(CommCost("pp", pp_link.kind, hops * boundary, hops * p2p, critical, words))
    dp_group = "dp_cp" if plan.zero == 0 else "dp_shard_cp"
    rs = total("zero_rs")
    add(
        "dp",
        dp_group,
        (tail.grad_exposed_s + rs[0], tail.grad_time_s + rs[1], tail.grad_bytes + rs[2]),
    )
    if tail.offload_time_s > 0:  # "all" offload's per-layer copies are in the zero-gather times
        out.append(
            CommCost(
                "offload",
                "pcie",
                tail.offload_bytes,
                tail.offload_time_s,
                tail.offload_exposed_s,
                "host copies over PCIe",
            )
        )
    return out
