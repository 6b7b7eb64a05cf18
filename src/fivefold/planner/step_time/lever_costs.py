"""Seconds of the memory levers: FP8 linears (GEMMs at the FP8 peak plus their casts), CPU
offload transfers and the host's optimizer step, and the MFU peak with FP8. Written by hand from
torchao's and FSDP2's code (the planner never imports torch); the derivations are in
docs/planner.md, section 4b.
"""

from __future__ import annotations

from fivefold.planner.memory.levers import (
    fp8_linear_params,
    gathers_fp8,
    node_host,
    offloads,
    resting_param_bytes,
)
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.compute import (
    Work,
    gemm_time_s,
    memory_time_s,
    optimizer_bytes_per_param,
    optimizer_step_s,
)
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.float8 import fp8_linears
from fivefold.specs.flops import training_flops_per_token
from fivefold.specs.geometry import dense_shard_degree, rank_tokens
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe

CAST_BYTES = 5.0  # per element: amax read (2) + cast read (2) and write (1)
PCIE_FRACTION = 0.8
HOST_BW_FRACTION = 0.7


# ---- FP8 linears -----------------------------------------------------------------------------
def fp8_gemms(model: ModelSpec, plan: ParallelPlan, moe: bool) -> list[tuple[float, float, float]]:
    """Forward GEMMs (m, n, k) of one layer's converted linears (`fp8_linears`) on one rank,
    the converted ones reading one input fused as `layer_matmuls.layer_gemms` fuses them (Q, K,
    V; gate and up); the output projections (out = hidden) split by input over TP, the others
    by output (torchao's float8 TP styles shard a Float8Linear as DTensor's shard a linear)."""
    t, h = plan.tp, model.hidden
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    fused: dict[str, list[float]] = {}
    out = []
    for w in fp8_linears(model, plan.fp8, moe):
        n, k = (w.out_features, w.in_features / t) if w.out_features == h else (
            w.out_features / t, w.in_features)  # fmt: skip
        if not w.reads:
            out.append((tokens, n, k))
        elif w.reads in fused:
            fused[w.reads][1] += n
        else:
            fused[w.reads] = [tokens, n, k]
            out.append(fused[w.reads])
    return [tuple(g) for g in out]


def fp8_layer_delta(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    moe: bool,
    selective_policy: str = "attention",
) -> Work:
    """What FP8 changes in one layer's `Work` for one micro-batch on one rank (negative where
    it saves): the converted GEMMs at the FP8 instead of the bf16 rate, plus their casts."""
    gemm = cast_f = cast_b = cast_w = 0.0
    shard = dense_shard_degree(plan) if gathers_fp8(plan) else 1
    for m, n, k in fp8_gemms(model, plan, moe):
        gemm += gemm_time_s(m, n, k, device, eff, "fp8") - gemm_time_s(m, n, k, device, eff)
        weight = k * n / shard  # the local weight, or its shard cast before an FP8 all-gather
        cast_f += CAST_BYTES * (m * k + weight)
        cast_b += CAST_BYTES * (m * n + weight)
        cast_w += CAST_BYTES * (m * n + m * k)
    forward = gemm + memory_time_s(cast_f, device, eff)
    recompute = 0.0
    if plan.recompute == "full":
        recompute = forward
    elif plan.recompute == "selective" and selective_policy == "alternate-matmul":
        recompute = forward / 2
    backward = gemm + memory_time_s(cast_b, device, eff) + recompute
    weight_s = gemm + memory_time_s(cast_w, device, eff)
    return Work(forward, backward, weight_s, recompute, gemm)


def fp8_flops_per_token(model: ModelSpec, fp8: str) -> float:
    """Model FLOPs per trained token in the linears FP8 recipe `fp8` converts (6 per parameter
    and token)."""
    dense = model.layers - model.moe_layers
    params = dense * fp8_linear_params(model, False, fp8)
    params += model.moe_layers * fp8_linear_params(model, True, fp8)
    return 6.0 * params


def mfu_peak(model: ModelSpec, plan: ParallelPlan, device: GPUSpec) -> float:
    """Per-GPU peak FLOP/s MFU and HFU are counted against (module docstring)."""
    base = device.peak(recipe(plan.precision).compute_dtype)
    if plan.fp8 == "none":
        return base
    total = training_flops_per_token(model, model.seq_len, "none")
    fp8 = fp8_flops_per_token(model, plan.fp8)
    return total / (fp8 / device.peak("fp8") + (total - fp8) / base)


# ---- offload ---------------------------------------------------------------------------------
def pcie_s(size_bytes: float, device: GPUSpec) -> float:
    """Seconds to move `size_bytes` one way over the GPU's host link."""
    if size_bytes <= 0:
        return 0.0
    return size_bytes / (device.pcie_bw_bytes_per_s * PCIE_FRACTION)


def host_stream_s(size_bytes: float, cluster: ClusterSpec) -> float:
    """Seconds for every GPU of a node to stream `size_bytes` each through host memory."""
    spec = node_host(cluster.gpu, cluster.device)
    return size_bytes * cluster.gpus_per_node / (spec.mem_bw_bytes_per_s * HOST_BW_FRACTION)


def optimizer_s(
    local_params: float, plan: ParallelPlan, cluster: ClusterSpec, eff: EfficiencyModel
) -> float:
    """The optimizer step over the rank's `local_params`: on the device, or with offload on the
    host CPU (memory-bound at the node's host bandwidth, shared by its GPUs)."""
    if not offloads(plan, cluster.device):
        return optimizer_step_s(local_params, plan, cluster.device, eff)
    return host_stream_s(local_params * optimizer_bytes_per_param(plan), cluster)


def offload_layer_s(shard_params: float, plan: ParallelPlan, device: GPUSpec) -> tuple:
    """ "all" offload, one layer: (host-to-device seconds of its parameter shard before a
    gather, device-to-host seconds of its gradient shard after the reduce-scatter)."""
    rec = recipe(plan.precision)
    return (
        pcie_s(shard_params * resting_param_bytes(rec), device),
        pcie_s(shard_params * rec.grad_bytes, device),
    )


def offload_tail(
    opt_params: float, plan: ParallelPlan, cluster: ClusterSpec, window_s: float
) -> tuple[float, float, float]:
    """(exposed seconds, transfer seconds, bytes over PCIe) a rank spends per step on offload
    outside the per-layer costs, for the `opt_params` parameters whose optimizer state it holds
    (module docstring); `window_s`: the backward time the gradient copy may hide behind."""
    device = cluster.device
    if not offloads(plan, device):
        return 0.0, 0.0, 0.0
    rec = recipe(plan.precision)
    grads = opt_params * rec.grad_bytes
    if plan.offload == "optimizer":
        params = opt_params * rec.param_bytes
        d2h, h2d = pcie_s(grads, device), pcie_s(params, device)
        return max(0.0, d2h - window_s) + h2d, d2h + h2d, grads + params
    accumulating = plan.grad_accum - 1
    copy = pcie_s(grads, device)
    add = host_stream_s(3 * grads, cluster)
    return accumulating * (copy + add), accumulating * copy, accumulating * grads
