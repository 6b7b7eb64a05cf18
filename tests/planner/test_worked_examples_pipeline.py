"""Worked examples of the distributed-training guides: the pipeline-bubble table, and the 7B
long-context case (a 7B model on 64 H100s with 128K-token documents and a 4M-token batch)."""

import re

import pytest

from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.schedule.actions import build_schedule
from fivefold.planner.schedule.simulation import StageCosts, closed_form_bubble, simulate
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import TIE_FRACTION
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.units import GiB


# ---- "Pipeline bubble" table (the CS 231n, 70B deep-dive and MIT 6.5940 lectures) ------------
@pytest.mark.parametrize(
    ("pp", "m", "bubble"),
    [
        (4, 1, 0.750),  # naive pipelining
        (4, 8, 0.273),
        (4, 12, 0.200),
        (4, 16, 0.158),
        (4, 32, 0.086),
        (16, 8, 0.652),
        (16, 64, 0.190),
        # The long-context case's table says ~25 % for p = 2, m = 4: that is (p-1)/m, the idle
        # time relative to the ideal time; as a fraction of the step it is (p-1)/(m+p-1) = 20 %.
        (2, 4, 0.200),
        (4, 4, 0.429),
    ],
)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_table(name, pp, m, bubble):
    sim = simulate(build_schedule(name, pp, 1, m), StageCosts.uniform(pp, 1.0, 2.0))
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert round(sim.bubble_fraction, 3) == pytest.approx(bubble, abs=5e-4)
    assert sim.step_time_s == pytest.approx((m + pp - 1) * 3.0)


def test_pp2_m4_relative_to_ideal_is_25_percent():
    sim = simulate(build_schedule("1f1b", 2, 1, 4), StageCosts.uniform(2, 1.0, 2.0))
    assert sim.bubble_over_ideal == pytest.approx(0.25)


@pytest.mark.parametrize(("pp", "vpp", "m"), [(4, 2, 8), (4, 4, 16), (16, 2, 64)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(pp, vpp, m):
    costs = StageCosts.uniform(pp * vpp, 1.0 / vpp, 2.0 / vpp)
    sim = simulate(build_schedule("interleaved-1f1b", pp, vpp, m), costs)
    assert sim.bubble_over_ideal == pytest.approx((pp - 1) / (vpp * m))
    assert sim.bubble_fraction == pytest.approx(closed_form_bubble(pp, m, vpp))


# ---- the 7B long-context case ----------------------------------------------------------------
STEPS = (
    "Tensor parallelism",
    "Micro-batch",
    "Pipeline",
    "Data parallelism",
    "Batch",
    "Context parallelism",
    "Expert parallelism",
    "Activation recompute",
)


@pytest.fixture(scope="module")
def long_context_7b():
    model = model_preset("vizz-7b").with_(seq_len=131072)
    cluster = cluster_preset("dgx-h100", 64)
    return model, cluster, search(model, cluster, global_batch_tokens=4 * 2**20)


def test_long_context_7b_layout_fits_with_tp_inside_a_node(long_context_7b):
    model, cluster, result = long_context_7b
    plan, best = result.best_plan, result.best
    assert plan.problems(model, cluster) == []
    assert best.peak_memory_bytes <= 0.9 * 80 * GiB  # fits with the 10 % headroom
    assert plan.tp <= cluster.gpus_per_node and cluster.gpus_per_node % plan.tp == 0
    assert plan.tp * plan.cp * plan.pp * plan.dp == 64


def test_long_context_7b_batch_is_about_4m_tokens(long_context_7b):
    model, _, result = long_context_7b
    tokens = result.best_plan.global_batch * model.seq_len
    assert abs(tokens - 4 * 2**20) <= 0.05 * 4 * 2**20  # the case's own: 4 x 128K x 8 = 4.19M


def test_long_context_7b_long_sequences_are_handled_by_cp_or_explained(long_context_7b):
    _, _, result = long_context_7b
    line = next(x for x in explain(result) if x.startswith("Context parallelism"))
    if result.best_plan.cp > 1:
        assert f"CP = {result.best_plan.cp}" in line
        assert f"{131072 // result.best_plan.cp:,}" in line  # tokens per GPU
    # Without CP: either slower (with the percentage) or out of memory (with GiB).
    assert re.search(r"without CP: .*(\d+\.\d% slower|out of memory by)", line)


def test_long_context_7b_recompute_is_used_or_argued_with_numbers(long_context_7b):
    _, _, result = long_context_7b
    line = next(x for x in explain(result) if x.startswith("Activation recompute"))
    others = {"none", "selective", "full"} - {result.best_plan.recompute}
    for policy in others:
        assert re.search(rf"{policy}: (\d+\.\d% slower|out of memory by \d)", line), line
    assert re.search(r"activations \d+\.\d GiB", line)


def test_long_context_7b_explanation_walks_the_staircase_with_numbers(long_context_7b):
    _, _, result = long_context_7b
    lines = explain(result)
    starts = [next(i for i, x in enumerate(lines) if x.startswith(step)) for step in STEPS]
    assert starts == sorted(starts)  # the case's order
    for i in starts:
        assert re.search(r"\d", lines[i]), lines[i]
    pipe = lines[starts[2]]
    assert "bubble" in pipe
    dp = lines[starts[3]]
    assert "ZeRO-" in dp and "GiB" in dp
    assert any(x.startswith("Runner-up") for x in lines)
    assert any(x.startswith("Rejected") and "out of memory by" in x for x in lines)


def test_long_context_7b_explanation_costs_the_literal_staircase(long_context_7b):
    _, _, result = long_context_7b
    line = next(
        x for x in explain(result) if x.startswith("The textbook rule of thumb taken literally")
    )
    assert "TP8+SP" in line  # TP fills the node
    assert re.search(r"(\d+\.\d% slower because|this very layout|the same speed)", line)


def test_long_context_7b_guide_layout_is_costed_and_not_faster(long_context_7b):
    # The case's own answer: TP 8 + SP, PP 2, DP 4, ZeRO-1, mbs 1, accumulation 8, checkpointing.
    model, cluster, result = long_context_7b
    guide = ParallelPlan(
        tp=8, sp=True, pp=2, dp_shard=4, zero=1, micro_batch=1, grad_accum=8, recompute="full"
    )
    est = estimate(model, cluster, guide)
    assert guide.global_batch * model.seq_len == 4 * 2**20
    assert est.fits
    # The search found something at least as fast (or the case's own layout).
    assert result.best.tokens_per_s >= est.tokens_per_s * (1 - TIE_FRACTION)
