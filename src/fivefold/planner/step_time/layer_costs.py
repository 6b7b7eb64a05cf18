"""Per-layer costs on one rank and micro-batch: compute plus the in-stage communication of
tensor, context and expert parallelism and ZeRO-3's per-layer gathers, each part exposed as far
as the compute beside it cannot hide it; cached on the plan fields a layer depends on
(`layer_cost_key`). The derivations are in docs/planner.md, sections 2 and 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from fivefold.planner.memory.activations import loss_chunk_tokens, sp_regathered_inputs
from fivefold.planner.memory.levers import gathers_fp8, offloads
from fivefold.planner.memory.model_states import (
    compute_bytes,
    fp8_gather_saving,
    layer_params_per_rank,
    local_kv_width,
)
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.comm import (
    TENSORS_PER_LAYER,
    Link,
    all_gather_bytes,
    all_gather_time_s,
    all_reduce_bytes,
    all_reduce_time_s,
    all_to_all_time_s,
    axis_groups,
    deduplicated_dispatch_time_s,
    issued_time_s,
    p2p_time_s,
    plan_link,
    reduce_scatter_time_s,
)
from fivefold.planner.step_time.compute import Work, layer_work, memory_time_s
from fivefold.planner.step_time.lever_costs import fp8_layer_delta, offload_layer_s
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.float8 import fp8_tensor_parallel
from fivefold.specs.geometry import expert_tp, moe_token_split, rank_tokens
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe


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


@dataclass(frozen=True)
class LayerSetting:
    """One layer on one rank for one micro-batch, as its communication costs read it: `key` the
    plan fields a layer depends on (`layer_cost_key`), `work` its compute, `e` bytes per
    activation element, `tokens` = b s/cp rows, `gap` the compute before each collective
    (`collective_gap_s`)."""

    model: ModelSpec
    key: ParallelPlan
    cluster: ClusterSpec
    eff: EfficiencyModel
    opts: PlannerOptions
    moe: bool
    work: Work
    e: int
    tokens: float
    gap: float | None

    def link(self, axis: str) -> Link:
        """The link the layer's `axis` collectives use."""
        return plan_link(self.cluster, self.key, axis, self.eff, self.gap)


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
    per step (`rank_tail.tail_costs`)."""
    return plan.zero == 3 and plan.pp == 1


def layer_cost_key(plan: ParallelPlan) -> ParallelPlan:
    """The plan fields a layer's cost depends on (others reset, for the cache)."""
    return ParallelPlan(
        tp=plan.tp,
        sp=plan.sp,
        cp=plan.cp,
        cp_kind=plan.cp_kind,
        ep=plan.ep,
        etp=plan.etp,
        dp_shard=plan.dp_shard,
        zero=3 if per_layer_gathers(plan) else 0,
        micro_batch=plan.micro_batch,
        recompute=plan.recompute,
        precision=plan.precision,
        offload="all" if plan.offload == "all" else "none",
        fp8=plan.fp8,
    )


@lru_cache(maxsize=65536)
def layer_costs(
    model: ModelSpec,
    key: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    moe: bool,
) -> LayerCosts:
    """The costs of one dense (`moe` False) or MoE layer; `key` = `layer_cost_key(plan)`."""
    device = cluster.device
    work = layer_work(model, key, device, eff, moe, opts.compute())
    if key.fp8 != "none":
        work = work + fp8_layer_delta(model, key, device, eff, moe, opts.selective_policy)
    setting = LayerSetting(
        model=model,
        key=key,
        cluster=cluster,
        eff=eff,
        opts=opts,
        moe=moe,
        work=work,
        e=recipe(key.precision).activation_bytes,
        tokens=rank_tokens(key.micro_batch, model.seq_len, key),
        gap=collective_gap_s(model, key, cluster, eff),
    )
    tp = _tp_costs(setting) if key.tp > 1 else (0.0,) * 4
    cp = _cp_costs(setting) if key.cp > 1 else (0.0,) * 4
    ep = _ep_costs(setting) if moe and key.ep > 1 else (0.0,) * 3
    zero = _zero3_costs(setting) if key.zero == 3 else (0.0,) * 6
    return LayerCosts(work, *tp, *cp, *ep, *zero)


def _tp_costs(s: LayerSetting) -> tuple[float, float, float, float]:
    """(exposed fwd, exposed bwd, transfer time, bytes) of tensor parallelism for one layer:
    2 collectives forward, 2 backward, 2 more with full recompute (a MoE layer's count:
    `tp_collectives`, and its router's gradient all-reduce backward, `router_grad_bytes`).
    With SP each is an all-gather and a reduce-scatter, and fivefold's eager blocks all-gather
    their kept input shards again in the backward (`sp_regathered_inputs`; Megatron's does
    too, behind its input-gradient GEMM, not priced for the fused profiles); tensorwise FP8
    all-gathers 1 byte per element where torchao's float8 styles cast before the gather
    (`fp8_tensor_parallel`: the inputs forward, the rowwise outputs' gradients backward), the
    reduce-scatters move the partial sums in `e`. Each collective also costs the runtime's
    DTensor redistribution its own CPU (`Link.host_s`: measured on a CPU, 0 on a GPU)."""
    model, key, opts, moe, e = s.model, s.key, s.opts, s.moe, s.e
    t, link = key.tp, s.link("tp")
    size = s.tokens * model.hidden
    pairs, gathers = tp_collectives(model, key, moe)
    if key.sp:
        fp8 = fp8_tensor_parallel(model, key.fp8, moe)

        def one(fp8_gather: bool) -> tuple[float, float]:
            gathered = size * (1 if fp8_gather else e)
            time = all_gather_time_s(gathered, t, link) + reduce_scatter_time_s(size * e, t, link)
            time += link.host_s("all_gather", t) + link.host_s("reduce_scatter", t)
            return time, all_gather_bytes(gathered, t) + all_gather_bytes(size * e, t)

        forward = [one(g) for g in fp8.gathered_inputs][:pairs]
        backward = [one(g) for g in fp8.gathered_grads][:pairs]
    else:
        both = (all_reduce_time_s(size * e, t, link), all_reduce_bytes(size * e, t))
        forward = backward = [both] * pairs
    gather_s = all_gather_time_s(size * e, t, link) + link.host_s("all_gather", t)
    lone = (gather_s, all_gather_bytes(size * e, t))
    forward, backward = forward + [lone] * gathers, backward + [lone] * gathers
    if moe and expert_tp(key) == 1:  # the router's gradient: a partial sum of own tokens
        grad = router_grad_bytes(model, e)
        backward = [*backward, (all_reduce_time_s(grad, t, link), all_reduce_bytes(grad, t))]
    if opts.fivefold_runtime and not opts.compile:  # the shards gathered again (sp_regather)
        backward = backward + [lone] * sp_regathered_inputs(model, key, moe)
    if key.recompute == "full":
        backward = backward + forward
    fwd, bwd = sum(c[0] for c in forward), sum(c[0] for c in backward)
    tp_time, tp_bytes = fwd + bwd, sum(c[1] for c in forward + backward)
    if opts.tp_comm_overlap:
        gemm = s.work.gemm_forward_s
        tp_fwd = fwd / t + max(0.0, fwd - gemm)
        tp_bwd = bwd / t + max(0.0, bwd - 2 * gemm)
    else:
        tp_fwd, tp_bwd = fwd, bwd
    return tp_fwd, tp_bwd, tp_time, tp_bytes


def tp_collectives(model: ModelSpec, key: ParallelPlan, moe: bool) -> tuple[int, int]:
    """(paired collectives, lone all-gathers) of one layer's forward under TP; the backward
    issues as many (the reverse of each), full recompute as many again. A pair is an all-gather
    and a reduce-scatter under SP, else an all-reduce. Dense: attention and MLP, two pairs.
    MoE (geometry's expert rule): attention's pair, the shared experts' pair (if any); the
    routed part communicates over EP only, its tokens already split over the TP ranks (under
    SP) or sliced locally, its output then all-gathered back to the replicated stream (one lone
    all-gather without SP; its backward gathers the input's gradient)."""
    if not moe or expert_tp(key) > 1:  # expert TP: the MoE block gathered and scattered whole
        return 2, 0
    pairs = 1 + (1 if model.shared_experts else 0)
    return pairs, 0 if key.sp else 1


def router_grad_bytes(model: ModelSpec, e: float) -> float:
    """Bytes of a MoE layer's router gradient [E, h] in the compute dtype (`e` bytes), which
    each TP rank makes from its own tokens under geometry's expert rule (the router replicated,
    `ReplicatedOwnTokens`): a partial sum that FSDP's gradient reduction first all-reduces over
    the TP group (DTensor's Partial to Replicate), once per backward of the layer."""
    return model.experts * model.hidden * e


def moe_tp_words(model: ModelSpec, plan: ParallelPlan) -> str:
    """The explanation's words for a MoE layer's TP collectives under geometry's expert rule
    (what `tp_collectives` and `router_grad_bytes` price)."""
    pairs = "attention's" + (" and the shared experts'" if model.shared_experts else "")
    kind = "all-gather / reduce-scatter" if plan.sp else "all-reduce"
    return (
        f"Each TP rank routes its 1/{plan.tp} of the tokens to whole experts; a MoE layer's "
        f"TP collectives are {pairs} {kind} pairs"
        + ("" if plan.sp else " and the routed output's all-gather")
        + f", and the router (replicated over TP, on each rank's own tokens) all-reduces "
        f"its {model.experts} x {model.hidden} gradient over the {plan.tp} TP ranks in each "
        "backward. "
    )


def _ep_costs(s: LayerSetting) -> tuple[float, float, float]:
    """(exposed fwd, exposed bwd, bytes) of expert parallelism for one MoE layer: the dispatch
    and combine all-to-alls, forward and backward, of the k copies of the rank's own tokens
    (its 1/tp of the micro-batch's: geometry's expert rule)."""
    model, key, link = s.model, s.key, s.link("ep")
    size = s.tokens / moe_token_split(key) * model.top_k * model.hidden * s.e
    if s.opts.ep_dispatch == "deepep":
        one = deduplicated_dispatch_time_s(size / model.top_k, model.top_k, key.ep, link)
    else:
        one = all_to_all_time_s(size, key.ep, link)
    ep_fwd = 2 * one
    ep_bwd = ep_fwd * (2 if key.recompute == "full" else 1)
    ep_bytes = (2 + 2 + (2 if key.recompute == "full" else 0)) * size * (key.ep - 1) / key.ep
    return ep_fwd, ep_bwd, ep_bytes


def _zero3_costs(s: LayerSetting) -> tuple[float, float, float, float, float, float]:
    """(gather s, gather bytes, reduce-scatter s, its bytes, gather copy s, reduce copy s) of
    ZeRO-3's per-layer gather and gradient reduce-scatter for one layer."""
    model, key, cluster, eff, opts = s.model, s.key, s.cluster, s.eff, s.opts
    device = cluster.device
    gather = gather_bytes = reduce = reduce_bytes = gather_copy = reduce_copy = 0.0
    rec = recipe(key.precision)
    lp = layer_params_per_rank(model, s.moe, key.tp, key.ep, key.etp)
    for params, group in (
        (lp.dense + lp.replicated, "dp_shard_cp"),
        (lp.experts, "expert_shard"),
    ):
        n = axis_groups(key)[group][0]
        if n <= 1 or params == 0:
            continue
        link = s.link(group)
        # FSDP gathers a wrapped layer at once; per-parameter hooks issue one per tensor.
        count = TENSORS_PER_LAYER if opts.collective_granularity == "parameter" else 1
        size = params * compute_bytes(rec)
        if group == "dp_shard_cp":  # FP8 all-gather of the converted linears
            size -= fp8_gather_saving(model, key, s.moe)
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
    return gather, gather_bytes, reduce, reduce_bytes, gather_copy, reduce_copy


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
    final norm on the last stage), the vocabulary-parallel loss all-reduces the row
    maximum (fp32, one per token), then the sum of exponentials and the target logit stacked
    (two per token), in each chunk of tokens (`loss_chunk_tokens`) forward, and
    tensorwise FP8 linears all-reduce the amax of each cast of a TP-sharded tensor
    (`fp8_scale_all_reduces`)."""
    link = plan_link(cluster, plan, "tp", eff, collective_gap_s(model, plan, cluster, eff))
    backward = 0.0
    if plan.sp:
        norm = all_reduce_time_s(model.hidden * recipe(plan.precision).grad_bytes, plan.tp, link)
        backward = (2 * layers + (1 if last else 0)) * norm
    forward = 0.0
    if last:
        tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
        chunks = math.ceil(tokens / loss_chunk_tokens(tokens, model.vocab / plan.tp))
        per_chunk = tokens / chunks
        forward = chunks * sum(all_reduce_time_s(per_chunk * b, plan.tp, link) for b in (4.0, 8.0))
    scales_fwd, scales_bwd = fp8_scale_all_reduces(model, plan)
    scale = all_reduce_time_s(4.0, plan.tp, link)
    return forward + layers * scales_fwd * scale, backward + layers * scales_bwd * scale


def fp8_scale_all_reduces(model: ModelSpec, plan: ParallelPlan) -> tuple[int, int]:
    """(forward, backward) all-reduces of one fp32 amax per layer and micro-batch under TP with
    tensorwise FP8 (torchao takes the amax of a sharded DTensor over the TP group): each
    converted weight cast forward and again backward (none under FSDP2's FP8 all-gather, whose
    scales are precomputed once per step), each rowwise linear's feature-sharded input and,
    with SP, each input cast before its all-gather forward; each colwise output's gradient and,
    with SP, each rowwise output's gradient backward. Full recompute repeats the forward's."""
    if plan.tp == 1 or plan.fp8 != "tensorwise":
        return 0, 0
    fp8 = fp8_tensor_parallel(model, plan.fp8, model.is_moe and not model.dense_layers)
    weights = 0 if gathers_fp8(plan) else fp8.colwise + fp8.rowwise
    forward = weights + fp8.rowwise + (sum(fp8.gathered_inputs) if plan.sp else 0)
    backward = weights + fp8.colwise + (fp8.rowwise if plan.sp else 0)
    return forward, backward + (forward if plan.recompute == "full" else 0)


def routing_sync_s(
    model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, eff: EfficiencyModel
) -> float:
    """Seconds of the small collectives fivefold's runtime adds to a MoE layer's forward, per
    micro-batch: the load-balancing statistics (per-expert counts and probability sums, fp64)
    all-reduced over the ranks that route different tokens (dp x cp x tp), and with expert
    parallelism the
    per-expert token counts exchanged (an all-to-all of int64) before the dispatch; both
    latency-bound, on the pipeline's critical path (`estimate` adds them to the stage costs)."""
    n = axis_groups(plan)["dp_cp_tp"][0]
    gap = collective_gap_s(model, plan, cluster, eff)
    total = 0.0
    if n > 1:
        stats = (2 * model.experts + 2) * 8.0
        total += all_reduce_time_s(stats, n, plan_link(cluster, plan, "dp_cp_tp", eff, gap))
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


def _cp_costs(s: LayerSetting) -> tuple[float, float, float, float]:
    """(exposed fwd, exposed bwd, transfer time, bytes) of context parallelism for one layer
    (fivefold's own ring for its runtime: `_ring_costs`)."""
    model, key, work, e, tokens = s.model, s.key, s.work, s.e, s.tokens
    cp, link = key.cp, s.link("cp")
    kv_block = tokens * 2 * local_kv_width(model, key.tp) * e
    if key.cp_kind == "ring" and s.opts.runtime == "fivefold-eager":
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


def _ring_costs(
    key: ParallelPlan, work: Work, kv_block: float, e: int, link: Link
) -> tuple[float, float, float, float]:
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
