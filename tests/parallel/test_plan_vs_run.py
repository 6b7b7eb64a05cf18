"""The planner's per-stage peak memory equals what fivefold's runtime measures, within 5 %.

Trains seven layouts of the small preset on CPU for three steps with the real runtime and loop
(through `benchmarks/plan_vs_run.py`, the full 24-layout benchmark; pp2-zbv for a split
backward, receive buffers and a rank with two chunks; pp2-zero3-dp2 for ZeRO-3 chunks kept
gathered through a pipelined step; dp2-zero1-offload-opt for the optimizer's host copies) and
compares, per pipeline stage, the runtime's measured peak (its tensor-storage counter) with the
planner's prediction under `runtime = "fivefold-eager"`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# On the path at collection, before any test starts the session's forkserver (which copies
# sys.path), so the ranks can unpickle the benchmark's worker by name.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
CI_LAYOUTS = (
    "1r",
    "dp2-zero3-accum2",
    "tp2-sp",
    "pp2-1f1b",
    "pp2-zbv",
    "pp2-zero3-dp2",
    "dp2-zero1-offload-opt",
)
TOLERANCE = 0.05


def _benchmark():
    import plan_vs_run

    return plan_vs_run


@pytest.mark.parametrize("name", CI_LAYOUTS)
def test_predicted_peak_within_5_percent(name: str) -> None:
    bench = _benchmark()
    (layout,) = bench.select(name, quick=False)
    rows = bench.flatten([bench.measure(layout, steps=3, timeout_s=240)])
    assert len(rows) == layout.full_plan.get("pp", 1)
    for row in rows:
        assert row["measured_peak_bytes"] > 0
        assert abs(row["memory_error"]) <= TOLERANCE, bench.table(rows)
        measured = row["measured_tenants"]
        predicted = row["predicted_tenants"]
        # Parameters and optimizer state are exact: the same tensors, counted two ways.
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=1e-4, abs=4096)


def _runtime(timed: list[float] | None):
    """A runtime as rank 0's report sees it (alone): the small preset, DP8 on an H100 node."""
    from types import SimpleNamespace

    import torch

    from fivefold.train.entry import load_run

    overrides = [
        'model.preset="small"',
        'cluster.preset="dgx-h100"',
        "plan.micro_batch=1",
        "plan.dp_replicate=8",
    ]
    run = load_run(None, overrides, world_size=8)
    fields = {"_step_times_s": timed} if timed is not None else {}
    return SimpleNamespace(
        recipe=run.recipe,
        device=torch.device("cpu"),
        world_size=1,
        is_main=True,
        peak_memory_bytes=lambda: 1,
        **fields,
    )


def test_step_time_compares_like_with_like() -> None:
    from dataclasses import replace

    from fivefold.parallel.report import predictions, stage_rows
    from fivefold.planner.estimate import estimate
    from fivefold.planner.options import PlannerOptions

    runtime = _runtime([0.5])
    recipe = runtime.recipe
    options = replace(PlannerOptions.for_device(recipe.cluster.device), runtime="fivefold-eager")
    est = estimate(recipe.model, recipe.cluster, recipe.plan, options=options)
    optimizer_s = est.breakdown_s["optimizer_s"]
    assert optimizer_s > 0
    # The runtime times train_step (no optimizer): the prediction drops the optimizer step.
    rows, note = stage_rows(runtime)
    assert rows[0]["measured_step_s"] == 0.5
    assert rows[0]["predicted_step_s"] == pytest.approx(est.step_time_s - optimizer_s)
    assert "without the optimizer step" in note
    # The loop times the whole step (clip and optimizer included): the whole prediction.
    rows, note = stage_rows(_runtime(None), step_s=0.7)
    assert rows[0]["predicted_step_s"] == pytest.approx(est.step_time_s)
    assert "without the optimizer" not in note
    assert predictions(runtime)[1] == pytest.approx(est.step_time_s)


@pytest.mark.parametrize("wrapped", [False, True])
def test_tenants_are_compared_only_as_both_sides_define_them(wrapped: bool) -> None:
    """On multi-process (FSDP2) runs the report printed `grads 14.3/0.0`: the counter books the
    unsharded gradients and gathered weights as activations, the planner as grads and params.
    There only the optimizer and the sum of the rest are compared; one process compares all."""
    from fivefold.parallel.report import TENANTS, format_rows, stage_rows

    runtime = _runtime(None)
    mib = 2**20
    runtime.peak_tenants = {"params": 5 * mib, "grads": 0, "optimizer": 7 * mib, "activations": mib}
    if wrapped:
        runtime.dp_modules = []  # what marks the FSDP2-wrapped runtime
    rows, note = stage_rows(runtime, step_s=0.5)
    (row,) = rows
    predicted, measured = row["predicted_tenants"], row["measured_tenants"]
    assert set(predicted) == set(measured)
    assert row["measured_storage_labels"] == runtime.peak_tenants  # the raw split is kept
    text = format_rows("layout", rows, note)
    if wrapped:
        assert set(measured) == {"optimizer", "params+grads+activations"}
        assert measured == {"optimizer": 7 * mib, "params+grads+activations": 6 * mib}
        assert "params+grads+activations" in text and "grads 0.0" not in text
        # true of plain DDP as of ZeRO: no "gathered weights" where nothing is gathered
        assert "/7.0, params+grads+activations " in text and text.endswith(
            "/6.0 (params, grads and activations compared as one sum: the data-parallel "
            "wrapper's weight and gradient storages look like activations to the counter)"
        )
    else:
        assert set(measured) == set(TENANTS) and measured["params"] == 5 * mib
        assert "grads " in text and "/0.0" in text
