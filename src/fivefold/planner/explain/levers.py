"""The explanation's memory-lever line: why none, or what nothing fits without and what they cost.

CPU offload, 8-bit Adam states and FP8 compute (`planner.memory.levers`); the search tries the
first two only when nothing fits without them, FP8 compute only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fivefold.planner.memory.levers import gathers_fp8, state_recipe
from fivefold.planner.quantities import gib, seconds
from fivefold.planner.step_time.lever_costs import fp8_flops_per_token, mfu_peak
from fivefold.specs.float8 import fp8_linears, fp8_tensor_parallel, layer_linears
from fivefold.specs.flops import training_flops_per_token
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe
from fivefold.units import GiB


def levers_line(result: Any, compare: Callable[..., str]) -> str:
    """The line for `result` (a `SearchResult`); `compare(label, **fields)` words the best
    layout with other levers against the chosen one."""
    p, est = result.best_plan, result.best
    used = lever_words(p)
    hbm = est.hbm_bytes / GiB
    usable = hbm * (1 - result.headroom)
    if not used:
        return (
            f"Memory levers: none; the layout fits in {hbm:.0f} GiB of HBM without CPU "
            "offload or 8-bit optimizer states, so the step pays for neither (the search "
            "tries them only when nothing fits; FP8 compute only when asked for, --fp8)."
        )
    miss = result.without_levers
    if miss is not None:
        text = (
            f"Memory levers: nothing fits in {hbm:.0f} GiB of HBM ({usable:.1f} GiB usable) "
            f"without them; the closest, {miss.plan.describe()}, is "
            f"{miss.reason.rstrip('.')}. Chose {', '.join(used)}: "
        )
    else:
        text = f"Memory levers: {', '.join(used)}, as asked: "
    text += _lever_costs(p, est, result.model, result.cluster.device)
    others = []
    for levers in result.search_state.lever_sets:
        full = {"offload": "none", "optimizer_states": "fp32", **levers}
        if levers and any(getattr(p, k) != v for k, v in full.items()):
            others.append(full)
    parts = [compare(" + ".join(lever_words(ParallelPlan(**lv))), **lv) for lv in others]
    return (text + " " + "; ".join(parts) + ("." if parts else "")).rstrip()


def _lever_costs(p: ParallelPlan, est: Any, model: ModelSpec, device: GPUSpec) -> str:
    mem = est.worst_memory
    parts = []
    if p.optimizer_states != "fp32":
        before = recipe(p.precision).optimizer_bytes
        parts.append(
            f"torchao's {p.optimizer_states} Adam states keep m and v at 1 byte plus an fp32 "
            f"scale per 256 values: {state_recipe(p).optimizer_bytes:.2f} optimizer bytes "
            f"per parameter instead of {before:g}"
            + (f" ({gib(mem.optimizer)} per GPU)" if p.offload == "none" else "")
        )
    host = est.host_memory
    if host is not None:
        what = "the optimizer state" if p.offload == "optimizer" else "parameters, gradients "
        what += "and optimizer state" if p.offload == "all" else ""
        parts.append(
            f"offloading {what} puts {gib(host.per_gpu_bytes)} per GPU, "
            f"{host.per_node_bytes / GiB:,.0f} GiB per node, in host memory "
            f"({host.node_ram_bytes / GiB:,.0f} GiB in a {host.system}, "
            f"{host.usable_bytes / GiB:,.0f} usable); the optimizer step runs on the host "
            f"CPU in {seconds(est.breakdown_s.get('optimizer_s', 0.0))} and the PCIe copies "
            f"expose {seconds(est.breakdown_s.get('offload_exposed_s', 0.0))} per step"
        )
    if p.fp8 != "none":
        parts.append(_fp8_words(p, model, device))
    return "; ".join(parts) + "."


def _fp8_words(p: ParallelPlan, m: ModelSpec, device: GPUSpec) -> str:
    share = fp8_flops_per_token(m, p.fp8) / training_flops_per_token(m, m.seq_len, "none")
    return (
        f"FP8 compute ({p.fp8} scaling, torchao float8) runs the attention projections and "
        f"MLP linears large enough to gain ({_converted_words(m, p.fp8)}), {share:.0%} of "
        f"the model FLOPs; MFU counts those against the FP8 peak "
        f"({device.peak('fp8') / 1e12:,.0f} TFLOP/s) and the rest (smaller linears, attention "
        f"core, LM head, routed experts) against bf16 ({device.peak('bf16') / 1e12:,.0f}), an "
        f"effective peak of {mfu_peak(m, p, device) / 1e12:,.0f} TFLOP/s"
        + ("; the weights are gathered in FP8 (half the bytes)" if gathers_fp8(p) else "")
        + _tp_words(p, m)
        + "; FP8 is usually slower than bf16 without train.compile (eager casts)"
    )


def _tp_words(p: ParallelPlan, m: ModelSpec) -> str:
    """What torchao's float8 TP styles gather in FP8 (`fp8_tensor_parallel`), "" if nothing."""
    if p.tp == 1 or not p.sp:
        return ""
    fp8 = fp8_tensor_parallel(m, p.fp8, m.is_moe and m.dense_layers == 0)
    n = sum(fp8.gathered_inputs) + sum(fp8.gathered_grads)
    if not n:
        return ""
    return f"; {n} of the 4 sequence-parallel all-gathers per layer move FP8 (1 byte per value)"


def _converted_words(m: ModelSpec, fp8: str) -> str:
    """How many of a layer's linears `fp8` converts, e.g. "5 of 7 per layer"."""
    moe = m.is_moe and m.dense_layers == 0
    return f"{len(fp8_linears(m, fp8, moe))} of {len(layer_linears(m, moe))} per layer"


def lever_words(plan: ParallelPlan) -> list[str]:
    """The memory levers a plan uses, in words ([] for none)."""
    out = []
    if plan.optimizer_states != "fp32":
        out.append(f"{plan.optimizer_states} Adam states")
    if plan.offload != "none":
        out.append("offload of " + ("the optimizer" if plan.offload == "optimizer" else "all"))
    if plan.fp8 != "none":
        out.append(f"FP8 {plan.fp8} compute")
    return out
