"""benchmarks/step_time_out_of_sample.py: every row repeated in interleaved passes, each row's
median and the spread of its passes (no ranks run here: the measurement is replaced)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # the bench imports plan_vs_run by name
    try:
        spec = importlib.util.spec_from_file_location(
            "step_time_out_of_sample", BENCHMARKS / "step_time_out_of_sample.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("step_time_out_of_sample", None)
        sys.path.remove(str(BENCHMARKS))


def sample(measured: float, cpu: float | None, load: float = 1.0) -> dict:
    return {
        "shape": "s", "kind": "1r", "describe": "", "predicted_step_s": 0.44,
        "measured_step_s": measured, "error": 0.44 / measured - 1.0, "memory_error": 0.0,
        "measured_cpu_s": cpu, "cpu_error": None, "load_before": load, "load_after": load,
        "wall_s": 1.0,
    }  # fmt: skip


def test_a_row_is_the_median_of_its_passes(bench):
    row = bench.median_row([sample(0.3, 0.2), sample(0.5, None, 3.0), sample(0.4, 0.6)])
    assert row["measured_step_s"] == pytest.approx(0.4)
    assert row["error"] == pytest.approx(0.44 / 0.4 - 1.0)
    assert row["measured_cpu_s"] == pytest.approx(0.4)  # the median of the two measured
    assert row["cpu_error"] == pytest.approx(0.1)
    assert row["spread"] == pytest.approx((0.5 - 0.3) / 0.4)
    assert row["repeats"] == 3 and row["load_before"] == 3.0
    assert row["measured_all_s"] == [0.3, 0.5, 0.4]


def test_passes_interleave_the_rows(bench, monkeypatch, capsys):
    """Pass 1 over every row, then pass 2: a change in the machine's load reaches all rows."""
    order = []
    times = iter([0.3, 0.6, 0.5, 0.2])

    def run_row(shape, kind, layout, steps):
        order.append(layout.name)
        return {**sample(next(times), None), "shape": shape.name, "kind": kind}

    monkeypatch.setattr(bench, "run_row", run_row)
    monkeypatch.setattr(bench, "extrapolated", lambda shape: "")
    assert bench.main(["--shapes", "mha-320,gqa3-192", "--layouts", "1r", "--repeats", "2"]) == 0
    assert order == ["mha-320/1r", "gqa3-192/1r"] * 2
    out = capsys.readouterr().out
    assert "## pass 2 of 2" in out and "## medians over 2 interleaved pass(es)" in out
    medians = out.split("## medians")[1]
    assert "mha-320/1r" in medians and "400.0" in medians  # the median of 300 and 500 ms


def test_repeats_must_be_positive(bench):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--repeats", "0", "--list"])
    assert stop.value.code == 2
