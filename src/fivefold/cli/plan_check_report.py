"""`fivefold plan check RECIPE`: the recipe's layout built at full scale on this CPU under a fake
process group and fake tensors (`fivefold.train.plan_check`), each pipeline stage's measured
peak beside the planner's prediction and beside the peak `fivefold plan` prints for the layout
(`Planned`), and whether the counted peak with the CUDA context and the allocator's
fragmentation fits the GPU. Exit status: 0 when every stage ran and fits, 1 when a stage does
not fit, 2 when one could not run. Imports torch only when run."""

from __future__ import annotations

import json
import time
from typing import Any

from fivefold.errors import ConfigError
from fivefold.train.plan_check_planned import Planned, planned_for
from fivefold.units import GiB as GIB
from fivefold.units import MiB as MIB

TARGET = 0.05  # the memory model's promise: predicted peak within 5 % of the checked one
DOES_NOT_FIT = 1  # exit status when a stage's counted peak does not fit the GPU
KERNEL_PATHS = {  # `fivefold.train.plan_check_kernels`' paths, in words
    "flash": "CUDA flash (fake kernel)",
    "flash_blocks": "CUDA flash varlen blocks (fake kernel)",
    "cpu": "CPU kernels",
    "cpu_blocks": "CPU blocks",
}
TRACKER_TENANTS = {  # torch's MemTracker categories (`_MemRefType` names), in our words
    "param": "params",
    "grad": "grads",
    "opt": "optimizer",
    "act": "activations",
    "temp": "temporaries",
    "buffer": "buffers",
    "oth": "other",
}


def run_check(recipe: Any, as_json: bool) -> int:
    """Check `recipe` on its cluster's GPUs and print the table (or JSON); 0 when every stage
    ran and fits, `DOES_NOT_FIT` when a stage's counted peak with context and fragmentation
    exceeds the usable GPU memory, 2 when a stage could not run (the table says which
    component and why)."""
    # lazily: fivefold.train.plan_check loads torch, which `fivefold plan` must not
    from fivefold.train.plan_check import as_json as checks_json
    from fivefold.train.plan_check import check_plan

    if recipe.plan.offload != "none":
        raise ConfigError(
            f"plan.offload = {recipe.plan.offload!r}: `plan check` measures device memory, "
            "which host offload moves out of a fake world's reach; check the layout with "
            "plan.offload = 'none'."
        )
    started = time.perf_counter()
    world = recipe.cluster.world_size
    planned = planned_for(recipe)
    checks = check_plan(recipe, world)
    seconds = time.perf_counter() - started
    if as_json:
        print(json.dumps(checks_report(planned, checks, checks_json(checks), seconds), indent=2))
    else:
        print(format_checks(recipe, world, checks, seconds, planned))
    return exit_status(planned, checks)


def exit_status(planned: Planned, checks: list) -> int:
    """2 when a stage could not run, `DOES_NOT_FIT` when one does not fit, else 0."""
    if any(c.problem for c in checks):
        return 2
    return DOES_NOT_FIT if any(planned.fits(c.counted_bytes) is False for c in checks) else 0


def checks_report(planned: Planned, checks: list, rows: list[dict], seconds: float) -> dict:
    """`plan check --json`: each stage's row (`plan_check.as_json`) with the plan's peak for
    it, the counted peak with context and fragmentation and whether that fits; the plan's
    settings and the usable memory."""
    for c, row in zip(checks, rows, strict=True):
        row["planned_bytes"] = planned.stage_bytes[c.stage] if planned.stage_bytes else None
        row["counted_whole_bytes"] = planned.whole_bytes(c.counted_bytes) if not c.problem else None
        row["fits"] = planned.fits(c.counted_bytes) if not c.problem else None
    return {
        "checks": rows,
        "planned": {
            "planner": planned.settings.to_json(),
            "step_time_s": planned.step_s,
            "usable_bytes": planned.usable_bytes,
            "headroom": planned.headroom,
            "why_not": planned.why_not,
        },
        "exit_status": exit_status(planned, checks),
        "seconds": seconds,
    }


def format_checks(
    recipe: Any, world: int, checks: list, seconds: float, planned: Planned | None = None
) -> str:
    """The check's table: one row per pipeline stage, then its tenants, then the verdict."""
    plan = recipe.plan
    planned = planned or planned_for(recipe)
    lines = [
        f"plan check: {recipe.model.name} on {world} x {recipe.cluster.gpu}, {plan.describe()}",
        f"  the runtime built for {world} ranks under a fake process group and fake tensors; one "
        "rank per pipeline stage ran one training step (optimizer state made beforehand)",
        "  counted: tensor storage live at the peak (no CUDA context, no allocator "
        "fragmentation), by fivefold's counter and by torch's MemTracker; predicted: the "
        "eager memory model's peak without those terms (error: predicted against counted)",
        f"  planned: the peak `fivefold plan` prints and chose by ({_planned_words(planned)}); "
        "whole: the counted peak with the CUDA context and fragmentation as planned",
        "",
        f"  {'stage':>5} {'rank':>5} {'planned':>10} {'predicted':>10} {'counted':>10} "
        f"{'MemTracker':>11} {'error':>8} {'whole':>10} {'vs plan':>8} {'time':>7} {'host':>9}",
    ]
    for c in checks:
        if c.problem:
            lines.append(f"  {c.stage:>5} {c.rank:>5}  could not run: {c.problem}")
            continue
        flag = "" if abs(c.error) <= TARGET else "  beyond 5 %"
        tracker = _size(c.tracker_bytes) if c.tracker_bytes else "-"
        whole = planned.whole_bytes(c.counted_bytes) if planned.usable_bytes else None
        mine = planned.stage_bytes[c.stage] if planned.stage_bytes else None
        versus = f"{100 * (mine / whole - 1):>+7.1f}%" if mine and whole else f"{'-':>8}"
        lines.append(
            f"  {c.stage:>5} {c.rank:>5} {_size(mine) if mine else '-':>10} "
            f"{_size(c.predicted_gib['total'] * GIB):>10} {_size(c.counted_bytes):>10} "
            f"{tracker:>11} {100 * c.error:>+7.1f}% {_size(whole) if whole else '-':>10} {versus} "
            f"{c.seconds:>6.1f}s {c.host_peak_mib:>5.0f} MiB{flag}"
        )
        lines += _tenant_lines(c)
        lines.append(f"        checked on: {describe_paths(c.kernels)}")
    lines += _verdict_lines(planned, checks)
    lines.append(f"  checked in {seconds:.1f} s")
    return "\n".join(lines)


def _planned_words(planned: Planned) -> str:
    """The profile the plan's peak comes from, and its step time."""
    opts, name = planned.settings.options, planned.settings.profile
    what = "fivefold's runtime" if opts.fivefold_runtime else "other software"
    if opts.fivefold_runtime:
        what += ", compiled blocks" if opts.compile else ", eager"
    if planned.stage_bytes is None:
        return f"profile {name}: {what}; no estimate: {planned.why_not}"
    return f"profile {name}: {what}; {planned.step_s:.2f} s per step"


def _verdict_lines(planned: Planned, checks: list) -> list[str]:
    """Whether every stage's whole peak fits the usable GPU memory, and what the check does
    not run (compiled blocks)."""
    ran = [c for c in checks if not c.problem]
    out = []
    if planned.settings.options.compile:
        out.append(
            "  note: train.compile is set; the check runs eager blocks (compiled ones keep less)"
        )
    if not ran:
        return out
    if not planned.usable_bytes:
        return [*out, "  fits: no GPU memory to fit on this cluster (a CPU)"]
    worst = max(ran, key=lambda c: c.counted_bytes)
    whole = planned.whole_bytes(worst.counted_bytes)
    usable = (
        f"{_size(planned.usable_bytes)} usable ({planned.hbm_bytes / GIB:.0f} GiB HBM less "
        f"{planned.headroom:.0%} headroom)"
    )
    if whole <= planned.usable_bytes:
        return [*out, f"  fits: stage {worst.stage}'s whole peak {_size(whole)} of {usable}"]
    return [
        *out,
        f"  DOES NOT FIT: stage {worst.stage}'s whole peak {_size(whole)} exceeds {usable}; "
        "this layout cannot run on these GPUs (exit status 1)",
    ]


def _size(nbytes: float) -> str:
    """Bytes in GiB, or in MiB below 1 GiB (CPU-sized runs)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _tenant_lines(check: Any) -> list[str]:
    predicted = ", ".join(
        f"{k} {_size(v * GIB)}"
        for k, v in check.predicted_gib.items()
        if k not in ("total", "allocated") and v
    )
    counted = ", ".join(f"{k} {_size(v)}" for k, v in check.counted_tenants.items() if v)
    tracker = ", ".join(
        f"{TRACKER_TENANTS.get(k, k)} {_size(v)}" for k, v in check.tracker_tenants.items() if v
    )
    return [
        f"        predicted:  {predicted}",
        f"        counted:    {counted}",
        f"        MemTracker: {tracker or check.tracker_note}",
    ]


def describe_paths(kernels: dict[str, int]) -> str:
    """Which kernels a checked rank's attention ran, and on what the rest ran."""
    if not kernels:
        return "CPU kernels on fake tensors (attention included)"
    used = ", ".join(f"{KERNEL_PATHS.get(k, k)} x {n}" for k, n in sorted(kernels.items()) if n)
    return f"attention {used}; the rest CPU kernels on fake tensors of the GPU run's shapes"
