"""The bounded search picks what costing every candidate in full would pick, under every
efficiency profile (its bounds use the same options as its estimates), and its speed-ups
(plans derived without `dataclasses.replace`, the collector paused) change no answer."""

from __future__ import annotations

import gc

import pytest

from fivefold.planner.budget.uncertainty import rank_tokens_per_s
from fivefold.planner.estimate import estimate
from fivefold.planner.frameworks import profile
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.bounds import Bounds
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import TIE_FRACTION, Outcome, rank_fitting
from fivefold.planner.search.state import _derive
from fivefold.specs import ParallelPlan, cluster_preset, model_preset

CASES = {
    "llama3-8b-16": ("llama3-8b", 16, {"global_batch": 64}),
    "mixtral-16": ("mixtral-8x7b", 16, {"global_batch_tokens": 2**21}),
}


def exhaustive_best(model, cluster, result, options, headroom: float = 0.10) -> Outcome:
    """Every candidate the search screened (valid, above the memory lower bound), costed."""
    budget = cluster.device.hbm_bytes * (1 - headroom)
    fits = []
    for cand in result.search_state.candidates:
        est = estimate(model, cluster, cand.plan, options)
        if est.peak_memory_bytes <= budget:
            fits.append(Outcome(cand.plan, est, "", "fits"))
    return rank_fitting(fits)[0]


def _check_search_equals_exhaustive(name, gpus, batch, profile_name):
    model, cluster = model_preset(name), cluster_preset("dgx-h100", gpus)
    options = profile(profile_name).planner_options(cluster.device)
    result = search(model, cluster, options=options, **batch)
    assert result.pruned_by_bound > 0  # the bounds skipped work
    assert result.evaluated < len(result.search_state.candidates)
    best = exhaustive_best(model, cluster, result, options)
    chosen, true = rank_tokens_per_s(result.best), rank_tokens_per_s(best.estimate)
    assert chosen >= true * (1 - TIE_FRACTION)  # ranked as the search ranks (risk setting)
    if result.best_plan != best.plan:  # only a tie may pick another layout
        assert true <= chosen / (1 - TIE_FRACTION)
    assert result.best.options == options


@pytest.mark.parametrize("profile_name", ["fivefold", "megatron-2022", "torchtitan"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bounded_search_equals_costing_every_candidate(case, profile_name):
    _check_search_equals_exhaustive(*CASES[case], profile_name)


@pytest.mark.slow
def test_405b_on_16384_gpus_equals_costing_every_candidate():
    """3,700 candidates costed in full: about 15 s on an idle core."""
    _check_search_equals_exhaustive(
        "llama3-405b", 16384, {"global_batch_tokens": 16 * 2**20}, "fivefold"
    )


@pytest.mark.parametrize("profile_name", ["megatron-2022", "nemo-2024", "torchtitan"])
def test_bounds_never_exceed_the_estimate_under_each_profile(profile_name):
    """The bounds are built with the search's options: with classic attention (s^2 scores)
    or eager kernels a default-options bound would not be a bound."""
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 16)
    options = profile(profile_name).planner_options(cluster.device)
    result = search(model, cluster, global_batch=64, options=options)
    bounds = Bounds(model, cluster, options)
    for cand in result.search_state.candidates[::7]:
        est = estimate(model, cluster, cand.plan, options)
        assert bounds.step(cand.plan) <= est.step_time_s * (1 + 1e-9), cand.plan.describe()
        inflight = list(est.peak_inflight)
        assert bounds.memory(cand.plan, inflight) <= est.peak_memory_bytes * (1 + 1e-9)


def test_classic_attention_changes_the_search_answer_memory():
    """Options reach the search: classic attention without recompute stores the scores, so
    the chosen layout's memory differs from flash's for the same layout."""
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 16)
    # the fused-kernel model with flash attention, which megatron-2022 changes to classic
    flash = search(model, cluster, global_batch=64, options=PlannerOptions())
    classic_opts = profile("megatron-2022").planner_options(cluster.device)
    classic = search(model, cluster, global_batch=64, options=classic_opts)
    same = estimate(model, cluster, flash.best_plan, classic_opts)
    if flash.best_plan.recompute == "none":
        assert same.peak_memory_bytes > flash.best.peak_memory_bytes
    assert classic.best.step_time_s > flash.best.step_time_s


def test_derived_plans_equal_with_():
    base = ParallelPlan(tp=2, pp=4, vpp=2, schedule="interleaved-1f1b", dp_shard=8, zero=1)
    derived = _derive(base, micro_batch=2, grad_accum=8, recompute="full")
    expected = base.with_(micro_batch=2, grad_accum=8, recompute="full")
    assert derived == expected and hash(derived) == hash(expected)
    assert derived.to_dict() == expected.to_dict()
    assert base.micro_batch == 1  # the original is untouched


def test_search_restores_the_collector_and_answers_the_same_with_it_off():
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 16)
    assert gc.isenabled()
    on = search(model, cluster, global_batch=64)
    assert gc.isenabled()
    gc.disable()
    try:
        off = search(model, cluster, global_batch=64)
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    assert on.best_plan == off.best_plan
    assert on.best.step_time_s == off.best.step_time_s
