"""The rank-0 layout report: per pipeline stage, the planner's predicted peak memory and step time
beside the measured ones, so every run checks the planner.

Measured step time is the mean wall time of `train_step` (forward + backward + gradient
communication of all micro-batches; the optimizer step is the loop's) over the steps after the
first. Measured peak memory: CUDA's allocator peak; on CPU, the tensor storages tracked during
one step (parameters, gradients, activations, buffers) plus the AdamW state (two fp32 copies of
the local parameters), which the step does not touch. The prediction is the planner's
`estimate` for the recipe's model, cluster and plan (skipped if the planner is unavailable).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

GIB = 1024**3


def predictions(runtime: Any) -> tuple[list[dict] | None, float | None, str]:
    """(memory per stage in GiB dicts, predicted step time in s, note) from the planner.

    Where the planner cannot time the device (a CPU run: no peak FLOP/s in the catalog), the
    memory is still predicted by its memory model, without the CUDA context and allocator
    fragmentation terms, which a CPU process does not have.
    """
    try:
        from fivefold.planner.estimate import estimate
    except ImportError:
        return None, None, "planner unavailable"
    cluster = runtime.recipe.cluster
    if not cluster.device.peak_flops:
        why = f"no step-time prediction: {cluster.gpu} has no catalogued peak FLOP/s"
    else:
        try:
            est = estimate(runtime.spec, cluster, runtime.plan).to_json()
            return est.get("memory_per_stage_gib"), est.get("step_time_s"), "planner estimate"
        except Exception as err:  # a planner gap must not stop training
            why = str(err).splitlines()[0]
    try:
        return memory_only_prediction(runtime.spec, runtime.plan), None, f"memory model only; {why}"
    except Exception as err:
        return None, None, f"planner: {why}; memory model: {err}"


def memory_only_prediction(spec: Any, plan: Any) -> list[dict]:
    """The planner's per-stage memory (GiB dicts) with no device terms."""
    from fivefold.planner.memory import MemoryOptions, all_stage_memory
    from fivefold.planner.schedule import build_schedule

    inflight = [1]
    if plan.pp > 1:
        inflight = list(
            build_schedule(plan.schedule, plan.pp, plan.vpp, plan.grad_accum).peak_inflight
        )
    options = MemoryOptions(
        cuda_context_bytes=0.0, fragmentation_fraction=0.0, runtime="fivefold-eager"
    )
    return [stage.gib() for stage in all_stage_memory(spec, plan, inflight, options)]


def stage_rows(runtime: Any) -> tuple[list[dict], str] | None:
    """Gather every rank's measurements (collective); on rank 0 return one row per pipeline
    stage with its ranks, predicted and measured peak bytes and step seconds (None where
    unknown), and the prediction's note. Other ranks get None."""
    times = runtime._step_times_s
    mine = {
        "rank": runtime.rank,
        "pp": runtime.pp_rank,
        "peak_bytes": runtime.peak_memory_bytes(),
        "tenants": dict(getattr(runtime, "peak_tenants", {}) or {}),
        "step_s": sum(times) / len(times) if times else None,
    }
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine)
    if not runtime.is_main:
        return None
    memory, step_s, note = predictions(runtime)
    rows = []
    for stage in range(runtime.plan.pp):
        mine = [g for g in gathered if g["pp"] == stage]
        measured_s = [g["step_s"] for g in mine if g["step_s"] is not None]
        top = max(mine, key=lambda g: g["peak_bytes"])
        peak = top["peak_bytes"]
        predicted = memory[stage] if memory and stage < len(memory) else None
        rows.append(
            {
                "stage": stage,
                "ranks": [g["rank"] for g in mine],
                "predicted_peak_bytes": predicted["total"] * GIB if predicted else None,
                "measured_peak_bytes": peak or None,
                "predicted_tenants": _tenant_bytes(predicted),
                "measured_tenants": top["tenants"],
                "predicted_step_s": step_s,
                "measured_step_s": max(measured_s) if measured_s else None,
            }
        )
    return rows, note


def _tenant_bytes(stage_gib: dict | None) -> dict[str, float]:
    """The planner's tenants of one stage in bytes, with "other" (buffers) under activations
    as the runtime's counter cannot tell them apart."""
    if not stage_gib:
        return {}
    out = {k: stage_gib[k] * GIB for k in ("params", "grads", "optimizer", "activations")}
    out["activations"] += stage_gib.get("other", 0.0) * GIB
    return out


def layout_report(runtime: Any) -> str | None:
    """Gather every rank's measurements (collective) and format the table on rank 0."""
    result = stage_rows(runtime)
    if result is None:
        return None
    rows, note = result
    return format_rows(runtime.plan.describe(), rows, note)


def format_rows(layout: str, rows: list[dict], note: str) -> str:
    lines = [
        f"layout report: {layout}  ({note})",
        f"  {'stage':>5}  {'ranks':>9}  {'pred peak':>10}  {'meas peak':>10}  "
        f"{'pred step':>10}  {'meas step':>10}",
    ]
    for row in rows:
        lines.append(
            f"  {row['stage']:>5}  {_ranks(row['ranks']):>9}  "
            f"{_gib(row['predicted_peak_bytes']):>10}  {_gib(row['measured_peak_bytes']):>10}  "
            f"{_ms(row['predicted_step_s']):>10}  {_ms(row['measured_step_s']):>10}"
        )
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return f"{value / GIB:.3f} GiB" if value else "n/a"


def _ms(value: float | None) -> str:
    return f"{value * 1e3:.1f} ms" if value else "n/a"


def _ranks(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
