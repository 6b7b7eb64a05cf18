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
    options = MemoryOptions(cuda_context_bytes=0.0, fragmentation_fraction=0.0)
    return [stage.gib() for stage in all_stage_memory(spec, plan, inflight, options)]


def layout_report(runtime: Any) -> str | None:
    """Gather every rank's measurements (collective) and format the table on rank 0."""
    times = runtime._step_times_s
    mine = {
        "rank": runtime.rank,
        "pp": runtime.pp_rank,
        "peak_bytes": runtime.peak_memory_bytes(),
        "step_s": sum(times) / len(times) if times else None,
    }
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine)
    if not runtime.is_main:
        return None
    memory, step_s, note = predictions(runtime)
    lines = [
        f"layout report: {runtime.plan.describe()}  ({note})",
        f"  {'stage':>5}  {'ranks':>9}  {'pred peak':>10}  {'meas peak':>10}  "
        f"{'pred step':>10}  {'meas step':>10}",
    ]
    for stage in range(runtime.plan.pp):
        rows = [g for g in gathered if g["pp"] == stage]
        ranks = [g["rank"] for g in rows]
        peak = max(g["peak_bytes"] for g in rows)
        measured_s = [g["step_s"] for g in rows if g["step_s"] is not None]
        predicted_mem = (
            f"{memory[stage]['total']:.3f} GiB" if memory and stage < len(memory) else "n/a"
        )
        lines.append(
            f"  {stage:>5}  {_ranks(ranks):>9}  {predicted_mem:>10}  "
            f"{(f'{peak / GIB:.3f} GiB' if peak else 'n/a'):>10}  "
            f"{(f'{step_s * 1e3:.1f} ms' if step_s else 'n/a'):>10}  "
            f"{(f'{max(measured_s) * 1e3:.1f} ms' if measured_s else 'n/a'):>10}"
        )
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
