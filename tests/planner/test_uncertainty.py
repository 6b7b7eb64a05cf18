"""Error bands, the calibrated domain, risk-aware ranking and the explanation's confidence."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.budget import uncertainty as U
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import confidence_line, explain, published_line
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import Outcome, rank_fitting
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.flops import training_flops_per_token

L405 = model_preset("llama3-405b")
H16K = cluster_preset("dgx-h100", 16384)
# The published expert layout (Llama 3 paper, Table 4): TP8 PP16 DP128 on 16,384 H100s, 41 % MFU.
PUBLISHED = ParallelPlan(
    tp=8,
    sp=True,
    pp=16,
    vpp=2,
    schedule="interleaved-1f1b",
    dp_shard=128,
    zero=2,
    micro_batch=1,
    grad_accum=16,
)
# What the search picked before it knew its errors: TP2 PP32 CP8 with 1,024 tokens per GPU.
BOLD = ParallelPlan(
    tp=2,
    sp=True,
    pp=32,
    vpp=2,
    schedule="zbv",
    dp_shard=32,
    zero=2,
    cp=8,
    micro_batch=1,
    grad_accum=64,
)


def test_band_from_residuals_by_hand():
    # Source "a" has two rows (weight 1/4 each), "b" one (1/2): the 10 % and 90 % quantiles.
    two = {"a": [("1", 0.05), ("2", -0.1)], "b": [("3", 0.2)]}
    assert U.residual_bounds(two) == (-0.1, 0.2)
    assert U.residual_bounds({"a": [("1", 0.05), ("2", 0.1)]}) == (0.0, 0.1)  # 0 always inside
    # 20 rows of one source (1/20 each): the lowest and the two highest fall outside 80 %.
    values = [-0.5, -0.1, *[0.0] * 15, 0.05, 0.1, 0.6]
    assert U.residual_bounds({"s": [(str(i), r) for i, r in enumerate(values)]}) == (-0.1, 0.05)
    band = U.band_of(10.0, (-0.1, 0.2), 0.0)
    assert (band.low_s, band.high_s) == (pytest.approx(10 / 1.2), pytest.approx(10 / 0.9))
    assert not band.outside
    wide = U.band_of(10.0, (-0.1, 0.2), 2.0, widening=0.05)
    assert wide.low_s == pytest.approx(10 / 1.2 / 1.05**2)
    assert wide.high_s == pytest.approx(10 / 0.9 * 1.05**2)
    assert wide.outside
    lo, hi = wide.mfu_range(0.5)
    assert lo == pytest.approx(0.5 * 0.9 / 1.05**2) and hi == pytest.approx(0.5 * 1.2 * 1.05**2)


def test_recorded_residuals_cover_most_of_every_sources_weight():
    residuals = U.held_out_residuals()
    assert len(residuals) >= 3
    lo, hi = U.residual_range()
    assert lo <= 0.0 <= hi
    inside = sum(
        sum(lo <= r <= hi for _, r in rows) / len(rows) for rows in residuals.values()
    ) / len(residuals)
    assert inside >= U.COVERAGE - 1e-9


def test_domain_distance_by_hand():
    a = {"tp": 8, "pp": 4, "dp": 32, "cp": 1, "ep": 1, "tokens_per_gpu": 2048, "params": 1e9}
    b = {"tp": 1, "pp": 64, "dp": 6, "cp": 1, "ep": 1, "tokens_per_gpu": 4096, "params": 1e12}
    domain = U.Domain.of([a, b], {"ampere"})
    assert domain.distance(a, "ampere") == 0.0
    x = {"tp": 2, "pp": 32, "dp": 32, "cp": 8, "ep": 1, "tokens_per_gpu": 1024, "params": 4e11}
    # CP 8 above 1 (3 doublings), 1,024 tokens below 2,048 (1), a new architecture (1).
    assert domain.excess(x, "hopper") == {"cp": 3.0, "tokens_per_gpu": 1.0, "gpu": 1.0}
    assert domain.distance(x, "hopper") == pytest.approx(5.0)
    words = domain.describe(x, "hopper")
    assert words[0] == "CP 8 above the calibrated 1-1 (3.0 doublings)"
    assert "tokens per GPU per micro-batch 1,024 below" in words[1]
    # Row distance: |log2| differences summed, +1 for another architecture.
    d = 3 + 4 + math.log2(32 / 6) + 0 + 0 + 1 + math.log2(1e12 / 1e9)
    assert U.run_distance(a, "ampere", b, "hopper") == pytest.approx(d + 1)


def test_rank_flips_when_the_optimistic_best_lies_outside(monkeypatch):
    # Two real layouts; the domain is made the slower one's point, residuals -10/+10 %.
    opts = PlannerOptions()
    one, two = estimate(L405, H16K, BOLD, opts), estimate(L405, H16K, PUBLISHED, opts)
    assert one.fits and two.fits and one.tokens_per_s != two.tokens_per_s
    fast, slow = sorted((one, two), key=lambda e: -e.tokens_per_s)
    point = U.layout_point(L405, slow.plan)
    monkeypatch.setattr(U, "calibrated_domain", lambda: U.Domain.of([point], {"hopper"}))
    monkeypatch.setattr(U, "residual_range", lambda: (-0.10, 0.10))
    U.domain_distance.cache_clear()
    try:
        # TP 2 vs 8 (2 doublings), PP 32 vs 16 (1), DP 32 vs 128 (2), CP 8 vs 1 (3), 1,024 vs
        # 8,192 tokens per GPU (3): 11 doublings between the two layouts, either way round.
        d = U.domain_distance(L405, H16K, fast.plan)
        assert d == pytest.approx(11.0)
        assert U.domain_distance(L405, H16K, slow.plan) == 0.0
        assert fast.tokens_per_s / slow.tokens_per_s < 1.05**11  # so the flip must happen
        assert U.rank_tokens_per_s(fast) == pytest.approx(fast.tokens_per_s * 0.9 / 1.05**11)
        assert U.rank_tokens_per_s(slow) == pytest.approx(slow.tokens_per_s * 0.9)
        outcomes = [Outcome(fast.plan, fast, "", "fits"), Outcome(slow.plan, slow, "", "fits")]
        assert rank_fitting(outcomes, "expected")[0].plan == fast.plan
        assert rank_fitting(outcomes, "pessimistic")[0].plan == slow.plan
    finally:
        U.domain_distance.cache_clear()


def test_search_ranks_by_the_slow_end_and_rejects_a_bad_risk():
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 64)
    with pytest.raises(ConfigError, match="risk = 'bold'"):
        search(model, cluster, risk="bold")
    result = search(model, cluster, global_batch_tokens=2**20)
    assert result.risk == "pessimistic"
    fits = [o for o in result.outcomes.values() if o.fits]
    best = U.rank_tokens_per_s(result.best)
    assert all(U.rank_tokens_per_s(o.estimate) <= best * (1 + 0.01) for o in fits)
    ranked = [U.rank_tokens_per_s(a) for a in result.alternatives]
    assert ranked == sorted(ranked, reverse=True)


def _measured_41_percent(model, cluster, plan):
    """The step time at which the published layout reaches 41 % MFU in our FLOP count."""
    tokens = plan.global_batch * model.seq_len
    flops = training_flops_per_token(model, model.seq_len, "none") * tokens
    return flops / (0.41 * cluster.device.peak("bf16") * cluster.world_size)


def test_explanation_names_the_nearest_run_and_prices_the_published_layout(monkeypatch):
    measured = _measured_41_percent(L405, H16K, PUBLISHED)
    row = SimpleNamespace(
        row="32",
        source="Llama 3 paper Table 4",
        model=L405,
        cluster=H16K,
        plan=PUBLISHED,
        options=PlannerOptions(tp_comm_overlap=True),
        measured_step_s=measured,
    )
    real = [entry for entry in U.calibration_points() if str(entry[0].row) != "32"]
    points = (*real, (row, U.layout_point(L405, PUBLISHED), "hopper"))
    monkeypatch.setattr(U, "calibration_points", lambda: points)
    assert U.published_layouts(L405, H16K) == [row]
    result = search(L405, H16K, global_batch_tokens=16 * 2**20)
    chosen = result.best
    band = U.band(chosen)
    lines = explain(result)
    conf = next(x for x in lines if x.startswith("Confidence:"))
    assert conf == confidence_line(chosen, "pessimistic")
    lo, hi = band.mfu_range(chosen.mfu)
    assert f"MFU {chosen.mfu:.1%} (band {lo:.1%}-{hi:.1%})" in conf
    nearest, dist = min(
        (
            (s, U.run_distance(U.layout_point(L405, chosen.plan), "hopper", p, a))
            for s, p, a in points
        ),
        key=lambda pair: pair[1],
    )
    assert f"Closest published run: row {nearest.row} " in conf and f"(distance {dist:.1f})" in conf
    assert ("OUTSIDE the calibrated domain" in conf) == band.outside
    pub = next(x for x in lines if x.startswith("Published layout, row 32"))
    assert pub == published_line(row, chosen)
    priced = estimate(L405, H16K, PUBLISHED, row.options, runtime=False)
    plo, phi = U.band(priced).mfu_range(priced.mfu)
    assert f"MFU {priced.mfu:.1%} (band {plo:.1%}-{phi:.1%})" in pub
    assert "measured step" in pub and "MFU 41.0%" in pub
    assert PUBLISHED.describe() in pub


def test_plan_json_carries_the_band(capsys):
    import json

    from fivefold.cli.main import main

    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64"]
    assert main([*argv, "--global-batch-tokens", "1M", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["search"]["risk"] == "pessimistic"
    r_lo, r_hi = U.residual_range()
    d = data["band"]["distance_doublings"]
    grow = (1 + U.WIDENING_PER_DOUBLING) ** d
    low, high = data["band"]["step_time_s"]
    assert low == pytest.approx(data["step_time_s"] / (1 + r_hi) / grow)
    assert high == pytest.approx(data["step_time_s"] / (1 + r_lo) * grow)
    assert data["band"]["outside_calibrated_domain"] == (d > 0)
