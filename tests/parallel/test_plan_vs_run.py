"""The planner's per-stage peak memory equals what fivefold's runtime measures, within 5 %.

Trains five layouts of the small preset on CPU for three steps with the real runtime and loop
(through `benchmarks/plan_vs_run.py`, the full 20-layout benchmark; pp2-zbv for a split
backward, receive buffers and a rank with two chunks) and compares, per pipeline
stage, the runtime's measured peak (its tensor-storage counter) with the planner's prediction
under `runtime = "fivefold-eager"`.
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
CI_LAYOUTS = ("1r", "dp2-zero3-accum2", "tp2-sp", "pp2-1f1b", "pp2-zbv")
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
