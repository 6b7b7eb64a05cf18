"""`fivefold plan check RECIPE`: the recipe's layout built at full scale on this CPU under a fake
process group and fake tensors (`fivefold.train.plan_check`), each pipeline stage's measured
peak beside the planner's prediction. Imports torch only when run."""

from __future__ import annotations

import json
import time
from typing import Any

from fivefold.errors import ConfigError
from fivefold.units import GiB as GIB
from fivefold.units import MiB as MIB

TARGET = 0.05  # the memory model's promise: predicted peak within 5 % of the checked one
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
    ran, 2 when one could not (the table says which component and why)."""
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
    checks = check_plan(recipe, world)
    seconds = time.perf_counter() - started
    if as_json:
        print(json.dumps({"checks": checks_json(checks), "seconds": seconds}, indent=2))
    else:
        print(format_checks(recipe, world, checks, seconds))
    return 0 if all(not c.problem for c in checks) else 2


def format_checks(recipe: Any, world: int, checks: list, seconds: float) -> str:
    """The check's table: one row per pipeline stage, then its tenants."""
    plan = recipe.plan
    lines = [
        f"plan check: {recipe.model.name} on {world} x {recipe.cluster.gpu}, {plan.describe()}",
        f"  the runtime built for {world} ranks under a fake process group and fake tensors; one "
        "rank per pipeline stage ran one training step (optimizer state made beforehand)",
        "  measured: tensor storage live at the peak (no CUDA context, no allocator "
        "fragmentation), by fivefold's counter and by torch's MemTracker; predicted: the "
        "planner's peak without those terms",
        "",
        f"  {'stage':>5} {'rank':>5} {'predicted':>10} {'counted':>10} {'MemTracker':>11} "
        f"{'error':>8} {'time':>7} {'host':>9}",
    ]
    for c in checks:
        if c.problem:
            lines.append(f"  {c.stage:>5} {c.rank:>5}  could not run: {c.problem}")
            continue
        flag = "" if abs(c.error) <= TARGET else "  beyond 5 %"
        tracker = _size(c.tracker_bytes) if c.tracker_bytes else "-"
        lines.append(
            f"  {c.stage:>5} {c.rank:>5} {_size(c.predicted_gib['total'] * GIB):>10} "
            f"{_size(c.counted_bytes):>10} {tracker:>11} "
            f"{100 * c.error:>+7.1f}% {c.seconds:>6.1f}s {c.host_peak_mib:>5.0f} MiB{flag}"
        )
        lines += _tenant_lines(c)
    lines.append(f"  checked in {seconds:.1f} s")
    return "\n".join(lines)


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
