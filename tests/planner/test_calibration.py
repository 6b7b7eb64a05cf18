"""Calibration: the published rows, the FLOP conventions, the recorded fit and its error table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fivefold.planner.calibration import (
    FITTED,
    EfficiencyModel,
    calibration_record,
    efficiency_model,
    published_runs,
)
from fivefold.planner.published import run_errors, run_setups

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
SHARED_ROWS = set(range(1, 11)) | set(range(36, 45)) | {60, 61}


def test_every_row_of_the_shared_table_is_present_with_a_source():
    rows = published_runs()
    assert {r["id"] for r in rows} == SHARED_ROWS
    for r in rows:
        assert r["source"] and r["measured"]["value"] > 0
        assert r["assumptions"]


def test_measured_step_times_by_hand():
    setups = {s.row: s for s in run_setups()}
    # Row 1, Megatron SC21 hardware FLOPs: 96 B s l h^2 (1 + s/6h + V/16lh) / (137 TFLOP/s * 32).
    b, s, n, h, v = 512, 2048, 24, 2304, 51200  # n = layers
    flops = 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))
    assert setups[1].measured_step_s == pytest.approx(flops / (137e12 * 32))
    assert setups[1].measured_step_s == pytest.approx(3.528, abs=0.001)
    # Row 36, Megatron-Core model FLOPs: 72 B s l h^2 (1 + s/6h + V/12lh) at 408.8 TFLOP/s, which
    # the source also gives as 41 % of 989 TFLOP/s.
    b, s, n, h, v = 192, 4096, 24, 2048, 131072
    flops = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    assert setups[36].measured_step_s == pytest.approx(flops / (408.8e12 * 48))
    assert round(408.8 / 989.4, 2) == 0.41
    # Row 60: 16 sequences of 8192 tokens on 8 GPUs at 5,762 tokens/s per GPU.
    assert setups[60].measured_step_s == pytest.approx(16 * 8192 / 8 / 5762)


def test_rows_map_to_their_published_layouts():
    setups = {s.row: s for s in run_setups()}
    r9 = setups[9]
    assert (r9.plan.tp, r9.plan.pp, r9.plan.vpp, r9.plan.dp) == (8, 35, 3, 9)
    assert r9.plan.global_batch == 2520 and r9.cluster.world_size == 2520
    r44 = setups[44]
    assert (r44.plan.tp, r44.plan.pp, r44.plan.dp) == (8, 16, 48)
    assert r44.plan.global_batch == 3072 and r44.cluster.world_size == 6144
    assert setups[61].plan.dp_shard == 128 and setups[61].plan.zero == 3


def test_record_matches_the_code():
    record = calibration_record()
    assert set(record["fit_rows"]).isdisjoint(record["held_out_rows"])
    assert set(record["fit_rows"]) | set(record["held_out_rows"]) == SHARED_ROWS
    assert record["fitted"] == list(FITTED)
    model = efficiency_model()
    assert model == EfficiencyModel.from_dict(record["parameters"])
    recorded = {e["row"]: e for e in record["errors"]}
    for err in run_errors(model):
        assert err.measured_step_s == pytest.approx(recorded[err.row]["measured_step_s"])
        assert err.predicted_step_s == pytest.approx(recorded[err.row]["predicted_step_s"])


def test_fitted_parameters_are_physical():
    m = efficiency_model()
    for arch, fraction in m.gemm_peak_fraction:
        assert 0.3 <= fraction <= 0.98, arch
    assert 0.35 <= m.attention_peak_fraction <= 0.75  # FlashAttention-2 on H100 .. FA-3
    assert 0.3 <= m.hbm_fraction <= 0.95
    assert 0 <= m.layer_overhead_s <= 1e-3
    assert m.attention_backward_ratio == 2.5


def test_error_table_is_reported_honestly_in_the_docs():
    record = calibration_record()
    errors = [abs(e["error"]) for e in record["errors"]]
    mean, worst = sum(errors) / len(errors), max(errors)
    assert record["summary"]["all"]["mean_abs_error"] == pytest.approx(mean)
    assert record["summary"]["all"]["max_abs_error"] == pytest.approx(worst)
    text = DOCS.read_text()
    assert f"{mean * 100:.1f} %" in text and f"{worst * 100:.1f} %" in text
    for e in record["errors"]:
        error = re.escape(f"{e['error'] * 100:+.1f} %")
        assert re.search(rf"\| {e['row']} \| {e['split']} \|.*\| {error} \|", text), e["row"]


def test_accuracy_does_not_regress():
    """Guards the current fit (mean 5.6 %, max 28.7 % over all 21 rows); the issue's target is a
    mean under 5 % and a max under 10 %, which docs/planner.md says is not met yet. Row 39 (TP 8,
    DP 48 over 48 nodes) carries the max: each layer's reduce-scatter and all-gather now pays its
    own 47-hop ring latency (`PlannerOptions.collective_granularity`)."""
    errors = [abs(e.error) for e in run_errors()]
    assert sum(errors) / len(errors) < 0.075
    assert max(errors) < 0.30


def test_torchtitan_rows_run_on_the_gpu_the_source_describes():
    from fivefold.spec.hardware import gpu

    setups = {s.row: s for s in run_setups()}
    for row in (60, 61):
        device = setups[row].cluster.device
        assert device.name == "h100-96gb-hbm2e"
        assert device.hbm_bw_bytes_per_s == 2.4e12  # "96GB HBM2e with 2.4 TB/sec"
        assert device.hbm_bytes == 96 * 2**30
        assert device.peak("bf16") == gpu("h100-sxm").peak("bf16")
        assert setups[row].cluster.inter_node_bw == 50e9  # "400 Gb/s per GPU"
    # The Megatron rows keep the catalog H100 SXM of the dgx-h100 preset.
    assert setups[39].cluster.device.hbm_bw_bytes_per_s == 3.35e12
