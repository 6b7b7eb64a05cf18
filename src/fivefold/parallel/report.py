"""The rank-0 layout report: per pipeline stage, the planner's predicted peak memory (tenant by
tenant) and step time beside the measured ones, so every run checks the planner.

Details: docs/internals.md (`fivefold.parallel.report`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from fivefold.parallel.device import unknown_gpu_reason
from fivefold.planner.estimate import estimate
from fivefold.planner.memory.options import MemoryOptions
from fivefold.planner.memory.stage import all_stage_memory
from fivefold.planner.options import PlannerOptions
from fivefold.planner.schedule.actions import build_schedule
from fivefold.units import GiB, MiB

TENANTS = ("params", "grads", "optimizer", "activations")
# Under FSDP2 (every multi-process run) the weights are gathered and the gradients unsharded
# into transient storages the counter cannot tell from activations, while the planner books
# them as parameters and gradients: only the optimizer state has one definition on both sides,
# so the rest is compared as one sum. One process (no wrapping) compares all four.
MERGED_NOTE = (  # true of every data-parallel wrapper: DDP (FSDP2's replicate) and ZeRO alike
    " (params, grads and activations compared as one sum: the data-parallel wrapper's weight "
    "and gradient storages look like activations to the counter)"
)
WRAPPED_GROUPS = {
    "optimizer": ("optimizer",),
    "params+grads+activations": TENANTS[:2] + TENANTS[3:],
}


def _wrapped(runtime: Any) -> bool:
    """Whether the runtime wraps its chunks in FSDP2 (the distributed runtime always does)."""
    return hasattr(runtime, "dp_modules")


def predictions(
    runtime: Any, optimizer: str = "adamw"
) -> tuple[list[dict] | None, float | None, str]:
    """(memory per stage in GiB dicts, predicted step time in s, note) for a built runtime; the
    step time is the whole step, optimizer included."""
    compiled = bool(getattr(runtime, "compiled", False))
    return predictions_for(
        runtime.recipe, runtime.device.type == "cuda", _wrapped(runtime), compiled, optimizer
    )


def predictions_for(
    recipe: Any, cuda: bool, fsdp_wrapped: bool, compiled: bool = False, optimizer: str = "adamw"
) -> tuple[list[dict] | None, float | None, str]:
    """`predictions` before any runtime exists (e.g. `train --dry-run`): `fsdp_wrapped` is true
    for the distributed runtime (more than one process), `compiled` under `train.compile`,
    `optimizer` is `train.optimizer`."""
    memory, estimate, note = _predict(recipe, cuda, fsdp_wrapped, compiled, optimizer)
    return memory, estimate.step_time_s if estimate is not None else None, note


def _predict(
    recipe: Any, cuda: bool, fsdp_wrapped: bool, compiled: bool = False, optimizer: str = "adamw"
) -> tuple[list[dict] | None, Any, str]:
    """(memory per stage in GiB dicts, the planner's `Estimate` or None, note)."""
    spec, plan, cluster = recipe.model, recipe.plan, recipe.cluster
    try:
        memory = memory_only_prediction(
            spec,
            plan,
            fsdp_wrapped=fsdp_wrapped,
            cuda=cuda,
            compiled=compiled,
            optimizer=optimizer,
        )
    except Exception as err:  # a planner gap must not stop training
        return None, None, f"memory model: {str(err).splitlines()[0]}"
    unknown = unknown_gpu_reason(cluster)
    if unknown:
        return memory, None, unknown
    if not cluster.device.peak_flops:
        return (
            memory,
            None,
            (
                f"no step-time prediction: {cluster.gpu} has no device peak (`fivefold "
                "calibrate --out PROFILE.toml` measures this machine; name it as [cluster] "
                "profile)"
            ),
        )
    try:
        options = replace(
            PlannerOptions.for_device(cluster.device, compile=compiled), optimizer=optimizer
        )
        est = estimate(spec, cluster, plan, options=options)
        return memory, est, f"planner estimate for {cluster.device.name}"
    except Exception as err:
        return memory, None, f"no step-time prediction: {str(err).splitlines()[0]}"


def memory_only_prediction(
    spec: Any,
    plan: Any,
    fsdp_wrapped: bool = True,
    cuda: bool = False,
    compiled: bool = False,
    optimizer: str = "adamw",
) -> list[dict]:
    """The planner's per-stage memory of this runtime (GiB dicts, "other" holds the buffers);
    a CPU has no CUDA context and no caching-allocator fragmentation, and its offloaded state
    stays in the memory the run measures. `compiled`: the blocks run under torch.compile."""
    inflight = [1]
    if plan.pp > 1:
        inflight = list(
            build_schedule(plan.schedule, plan.pp, plan.vpp, plan.grad_accum).peak_inflight
        )
    options = MemoryOptions(
        runtime="fivefold-eager", fsdp_wrapped=fsdp_wrapped, compiled=compiled, optimizer=optimizer
    )
    if not cuda:
        options = replace(options, cuda_context_bytes=0.0, fragmentation_fraction=0.0)
    if not cuda and plan.offload == "all":
        plan = plan.with_(offload="none")  # FSDP2's offload to the CPU it runs on moves nothing
    out = []
    for stage in all_stage_memory(spec, plan, inflight, options):
        if not cuda:  # the "host" is this memory: offload="optimizer"'s host copies count here
            stage = replace(stage, optimizer=stage.optimizer + stage.host_bytes, host_bytes=0.0)
        gib = stage.gib()
        gib["grads"] *= stage.grads_at_peak  # FSDP2 allocates them in a chunk's first backward
        # What `max_memory_allocated` can see: the total less the CUDA context and the
        # allocator's fragmentation (equal to the total on a CPU, which has neither).
        outside = sum(stage.other_terms.get(k, 0.0) for k in ("cuda_context", "fragmentation"))
        gib["allocated"] = gib["total"] - outside / GiB
        out.append(gib)
    return out


def stage_rows(
    runtime: Any, step_s: float | None = None, optimizer: str = "adamw"
) -> tuple[list[dict], str] | None:
    """Gather every rank's measurements (collective when distributed); on rank 0 return one
    row per pipeline stage (ranks, predicted and measured peak bytes and tenants, step seconds;
    None where unknown) and the prediction's note. Other ranks get None. `step_s`: the measured
    step time when the runtime does not time its own steps; `optimizer`: `train.optimizer`."""
    times = getattr(runtime, "_step_times_s", None) or []  # train_step: no optimizer step
    mine = {
        "rank": getattr(runtime, "rank", 0),
        "pp": getattr(runtime, "pp_rank", 0),
        "peak_bytes": runtime.peak_memory_bytes(),
        "reserved_bytes": getattr(runtime, "peak_reserved_bytes", 0),
        "tenants": dict(getattr(runtime, "peak_tenants", {}) or {}),
        "step_s": sum(times) / len(times) if times else step_s,
    }
    gathered: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and runtime.world_size > 1:
        gathered = [None] * runtime.world_size
        dist.all_gather_object(gathered, mine)
    if not runtime.is_main:
        return None
    cuda = runtime.device.type == "cuda"
    compiled = bool(getattr(runtime, "compiled", False))
    memory, estimate, note = _predict(runtime.recipe, cuda, _wrapped(runtime), compiled, optimizer)
    predicted_s = estimate.step_time_s if estimate is not None else None
    if predicted_s is not None and times:
        # The runtime times its own `train_step` (forward, backward, gradient communication):
        # compare it with the prediction less the planner's optimizer step.
        predicted_s -= estimate.breakdown_s.get("optimizer_s", 0.0)
        note += ", step time without the optimizer step (train_step is timed)"
    plan = runtime.recipe.plan
    wrapped = _wrapped(runtime)
    rows = []
    for stage in range(plan.pp):
        ranks = [g for g in gathered if g["pp"] == stage]
        top = max(ranks, key=lambda g: g["peak_bytes"])
        measured_s = [g["step_s"] for g in ranks if g["step_s"] is not None]
        predicted = memory[stage] if memory and stage < len(memory) else None
        # Like with like: the allocated peak against the prediction without CUDA context and
        # fragmentation; the reserved peak plus the context against the whole prediction.
        rows.append(
            {
                "stage": stage,
                "ranks": [g["rank"] for g in ranks],
                "predicted_peak_bytes": predicted["allocated"] * GiB if predicted else None,
                "measured_peak_bytes": top["peak_bytes"] or None,
                "predicted_reserved_bytes": predicted["total"] * GiB if predicted else None,
                "measured_reserved_bytes": top.get("reserved_bytes") or None,
                "predicted_tenants": comparable(_tenant_bytes(predicted), wrapped),
                "measured_tenants": comparable(top["tenants"], wrapped),
                "measured_storage_labels": top["tenants"],  # the counter's own split
                "predicted_step_s": predicted_s,
                "measured_step_s": max(measured_s) if measured_s else None,
            }
        )
    return rows, note


def layout_report_record(
    runtime: Any,
    report_step: bool,
    step_s: float,
    say: Callable[..., None],
    optimizer: str = "adamw",
) -> dict | None:
    """The planner-vs-measured record (`record`) of the step just read back, if there is one:
    the distributed runtime reports on its own (collectively, inside its step; taken here); a
    one-process runtime is reported on `report_step`, timed at `step_s` s per step, its table
    said through `say` (a console's print); `optimizer`: train.optimizer, as `stage_rows`."""
    taken = getattr(runtime, "plan_vs_run", None)
    if taken is not None:
        runtime.plan_vs_run = None
        return taken
    if hasattr(runtime, "last_report") or not report_step:
        return None
    rows, note = stage_rows(runtime, step_s=step_s, optimizer=optimizer)
    say(format_rows(runtime.recipe.plan.describe(), rows, note), markup=False)
    return record(rows, note)


def _tenant_bytes(stage_gib: dict | None) -> dict[str, float]:
    """The planner's tenants of one stage in bytes, with "other" (buffers) under activations,
    as the runtime's counter cannot tell them apart."""
    if not stage_gib:
        return {}
    out = {k: stage_gib[k] * GiB for k in TENANTS}
    out["activations"] += stage_gib.get("other", 0.0) * GiB
    return out


def comparable(tenants: dict[str, float], wrapped: bool) -> dict[str, float]:
    """The tenants in the groups both sides define alike (`WRAPPED_GROUPS` under FSDP2)."""
    if not tenants or not wrapped:
        return dict(tenants)
    return {
        group: sum(tenants.get(name, 0) for name in names)
        for group, names in WRAPPED_GROUPS.items()
    }


def error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1, or None when either is unknown."""
    if not predicted or not measured:
        return None
    return predicted / measured - 1.0


def record(rows: list[dict], note: str) -> dict:
    """The JSON form written to metrics.jsonl (`plan_vs_run`): per stage, bytes and seconds
    predicted and measured, with the relative errors."""
    stages = []
    for row in rows:
        entry = dict(row)
        entry["memory_error"] = error(row["predicted_peak_bytes"], row["measured_peak_bytes"])
        entry["reserved_error"] = error(
            row.get("predicted_reserved_bytes"), row.get("measured_reserved_bytes")
        )
        entry["step_error"] = error(row["predicted_step_s"], row["measured_step_s"])
        stages.append(entry)
    return {"note": note, "stages": stages}


def format_rows(layout: str, rows: list[dict], note: str) -> str:
    lines = [
        f"layout report: {layout}  ({note})",
        f"  {'stage':>5}  {'ranks':>9}  {'pred peak':>10}  {'meas peak':>10}  {'error':>7}  "
        f"{'pred step':>10}  {'meas step':>10}  {'error':>7}",
    ]
    for row in rows:
        lines.append(
            f"  {row['stage']:>5}  {_ranks(row['ranks']):>9}  "
            f"{_gib(row['predicted_peak_bytes']):>10}  {_gib(row['measured_peak_bytes']):>10}  "
            f"{_pct(error(row['predicted_peak_bytes'], row['measured_peak_bytes'])):>7}  "
            f"{_ms(row['predicted_step_s']):>10}  {_ms(row['measured_step_s']):>10}  "
            f"{_pct(error(row['predicted_step_s'], row['measured_step_s'])):>7}"
        )
        if row.get("measured_reserved_bytes"):
            pred_all, meas_all = row["predicted_reserved_bytes"], row["measured_reserved_bytes"]
            lines.append(
                f"         peak above: allocated, without CUDA context and fragmentation; "
                f"reserved + context: predicted {_gib(pred_all)}, measured {_gib(meas_all)}, "
                f"{_pct(error(pred_all, meas_all))}"
            )
        pred, meas = row["predicted_tenants"], row["measured_tenants"]
        if pred and meas:
            cells = ", ".join(
                f"{name} {pred.get(name, 0) / MiB:.1f}/{meas.get(name, 0) / MiB:.1f}"
                for name in pred
            )
            why = "" if set(pred) == set(TENANTS) else MERGED_NOTE
            lines.append(f"         MiB predicted/measured: {cells}{why}")
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return f"{value / GiB:.3f} GiB" if value else "n/a"


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.1f} ms" if value else "n/a"


def _pct(value: float | None) -> str:
    return f"{100 * value:+.1f}%" if value is not None else "n/a"


def _ranks(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
