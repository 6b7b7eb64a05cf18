"""The layout search: valid proposals only, exact pruning, pins, headroom, batch target, speed."""

import random
import time

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.bounds import Bounds
from fivefold.planner.search.candidates import (
    dp_splits,
    hsdp_shards,
    micro_batch_choices,
    tp_choices,
)
from fivefold.planner.search.layouts import search
from fivefold.planner.search.outcomes import TIE_FRACTION, batch_target
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.units import GiB


@pytest.fixture(scope="module")
def llama8b_64():
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 64)
    return model, cluster, search(model, cluster, global_batch_tokens=2**20)


def _fitting(result):
    return [o for o in result.outcomes.values() if o.fits]


def test_search_never_proposes_an_invalid_layout(llama8b_64):
    model, cluster, result = llama8b_64
    fitting = _fitting(result)
    assert len(fitting) >= 5
    usable = 0.9 * cluster.device.hbm_bytes
    for o in fitting:
        p = o.plan
        assert p.problems(model, cluster) == []
        assert p.world_size == 64
        assert cluster.gpus_per_node % p.tp == 0  # TP inside a node
        assert o.estimate.peak_memory_bytes <= usable
        tokens = p.global_batch * model.seq_len
        assert abs(tokens - 2**20) <= 0.05 * 2**20
    assert result.best.plan == result.best_plan
    assert result.best_plan.problems(model, cluster) == []


def test_alternatives_are_ranked_by_tokens_per_s(llama8b_64):
    _, _, result = llama8b_64
    speeds = [a.tokens_per_s for a in result.alternatives]
    assert speeds == sorted(speeds, reverse=True)
    best = result.best.tokens_per_s
    # nothing that fits is faster than the best by more than the tie band
    assert max(o.estimate.tokens_per_s for o in _fitting(result)) <= best * (1 + 2 * TIE_FRACTION)
    assert len(result.alternatives) == 4  # top = 5 including the best


def test_rejections_carry_their_reason(llama8b_64):
    _, _, result = llama8b_64
    assert result.rejected
    reasons = [r for _, r in result.rejected]
    memory = [r for r in reasons if r.startswith("out of memory by")]
    assert memory and all("GiB" in r for r in memory)
    overflow = [o.overflow_bytes for o in result.outcomes.values() if o.kind == "memory"]
    assert min(overflow) >= 0


def test_pruning_by_bounds_loses_nothing():
    # Cost every screened candidate in full and compare with what the bounded search picked.
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 8)
    result = search(model, cluster, global_batch=32, fixed={"recompute": "selective"})
    state = result.search_state
    # the bounds did skip work: 86 layouts under fivefold's eager memory (the default, whose
    # bound is the estimate's own memory of the first and last rank), more than 100 under the
    # fused-kernel model (PlannerOptions())
    assert result.pruned_by_bound > 80
    best = 0.0
    for cand in state.candidates:
        est = estimate(model, cluster, cand.plan)
        if est.fits_with(0.10):
            best = max(best, est.tokens_per_s)
    assert result.best.tokens_per_s >= best * (1 - TIE_FRACTION) - 1e-9


def test_bounds_never_exceed_the_estimate():
    rng = random.Random(0)
    for name, gpus, tokens in (
        ("llama3-70b", 256, 4 * 2**20),
        ("vizz-7b", 64, 4 * 2**20),
        ("mixtral-8x7b", 16, 2**21),
    ):
        model, cluster = model_preset(name), cluster_preset("dgx-h100", gpus)
        # fivefold's eager memory (the default) and the fused-kernel model
        for opts in (PlannerOptions.for_device(cluster.device), PlannerOptions()):
            _bounds_hold(model, cluster, tokens, opts, rng)


def _bounds_hold(model, cluster, tokens, opts, rng) -> None:
    result = search(model, cluster, global_batch_tokens=tokens, options=opts)
    bounds = Bounds(model, cluster, opts)
    for cand in rng.sample(result.search_state.candidates, 15):
        est = estimate(model, cluster, cand.plan, opts)
        assert bounds.step(cand.plan) <= est.step_time_s * (1 + 1e-9), cand.plan.describe()
        inflight = list(est.peak_inflight)
        assert bounds.memory(cand.plan, inflight) <= est.peak_memory_bytes * (1 + 1e-9)


def test_pinned_fields_are_kept():
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 64)
    result = search(model, cluster, global_batch_tokens=2**20, fixed={"tp": 8, "pp": 2})
    assert result.best_plan.tp == 8 and result.best_plan.pp == 2
    assert all(a.plan.tp == 8 and a.plan.pp == 2 for a in result.alternatives)
    dp = search(model, cluster, global_batch_tokens=2**20, fixed={"dp": 8})
    assert dp.best_plan.dp == 8


def test_headroom_is_respected():
    model, cluster = model_preset("llama3-70b"), cluster_preset("dgx-h100", 64)
    for headroom in (0.05, 0.5):
        result = search(model, cluster, global_batch_tokens=2**21, headroom=headroom)
        limit = (1 - headroom) * 80 * GiB
        assert result.best.peak_memory_bytes <= limit
        assert all(a.peak_memory_bytes <= limit for a in result.alternatives)


def test_batch_target_in_sequences_and_tokens():
    model = model_preset("llama3-8b")
    assert batch_target(model, 4 * 2**20, None).sequences == 512
    assert batch_target(model, None, 96).sequences == 96
    assert batch_target(model, None, None).tokens == 4 * 2**20  # the documented default
    target = batch_target(model, None, 100)
    assert target.accumulation(1, 32) == 3  # 96 sequences: 4 % off, within 5 %
    assert target.accumulation(1, 40) is None  # 80 or 120: more than 5 % off
    assert target.accumulation(2, 10) == 5
    assert micro_batch_choices(target, 8) == [1, 2, 4, 8]  # up to 100 * 1.05 / 8 = 13


def test_enumeration_helpers():
    assert tp_choices(model_preset("llama3-8b"), cluster_preset("dgx-h100", 64)) == [1, 2, 4, 8]
    # tiny: 4 heads, 2 kv heads (TP 4 replicates them), 176-wide MLP
    assert tp_choices(model_preset("tiny"), cluster_preset("dgx-h100", 8)) == [1, 2, 4]
    assert dp_splits(1, 1) == [(1, 1, 0)]
    assert (4, 1, 0) not in dp_splits(4, 1)  # plain DP only when asked for
    assert (4, 1, 0) in dp_splits(4, 1, with_plain=True)
    assert hsdp_shards(dp=64, cp=1, tp=8, gpus_per_node=8) == [2, 4, 8]  # 2, 4, 8 nodes
    assert hsdp_shards(dp=64, cp=1, tp=1, gpus_per_node=8) == [8, 16, 32]


def test_moe_search_uses_expert_parallelism_validly():
    model, cluster = model_preset("mixtral-8x7b"), cluster_preset("dgx-h100", 16)
    result = search(model, cluster, global_batch_tokens=2**21)
    for o in _fitting(result):
        assert model.experts % o.plan.ep == 0
        # EP takes its ranks from dp_shard x cp x tp (specs/geometry.py)
        assert (o.plan.dp_shard * o.plan.cp * o.plan.tp) % o.plan.ep == 0
    assert any(o.plan.ep > 1 for o in result.outcomes.values() if o.kind in ("fits", "memory"))


def test_no_layout_fits_says_what_came_closest():
    model, cluster = model_preset("llama3-405b"), cluster_preset("dgx-h100", 8)
    with pytest.raises(ConfigError) as err:
        search(model, cluster, global_batch_tokens=2**20)
    text = str(err.value)
    assert "no layout of llama3-405b fits 8 x h100-sxm" in text
    assert "Closest:" in text and "out of memory by" in text


def test_405b_on_16384_gpus_is_fast():
    model, cluster = model_preset("llama3-405b"), cluster_preset("dgx-h100", 16384)
    started = time.process_time()
    result = search(model, cluster, global_batch_tokens=16 * 2**20)
    elapsed = time.process_time() - started
    # The goal is < 2 s on an idle core; CI shares 2 cores, so the bound here is generous.
    assert elapsed < 10.0
    assert result.best_plan.world_size == 16384
    assert result.best.peak_memory_bytes <= 0.9 * 80 * GiB
    assert result.best_plan.global_batch * model.seq_len == 16 * 2**20
    assert result.evaluated < 500  # the bounds, not brute force, did the work


def test_bad_search_arguments():
    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 8)
    with pytest.raises(ConfigError, match=r"headroom = 1\.2"):
        search(model, cluster, headroom=1.2)
    with pytest.raises(ConfigError, match="not a plan setting"):
        search(model, cluster, fixed={"tensor": 2})
    with pytest.raises(ConfigError, match="precision 'fp4' is unknown"):
        search(model, cluster, precisions=("fp4",))
    with pytest.raises(ConfigError, match="not both"):
        search(model, cluster, global_batch=8, global_batch_tokens=2**20)
    with pytest.raises(ConfigError, match="at least one sequence"):
        search(model, cluster, global_batch_tokens=100)


def test_plan_from_search_round_trips_through_estimate(llama8b_64):
    model, cluster, result = llama8b_64
    again = estimate(model, cluster, ParallelPlan(**result.best_plan.to_dict()))
    assert again.tokens_per_s == pytest.approx(result.best.tokens_per_s)


def test_memory_shortfall_is_never_zero_gib():
    from fivefold.planner.search.outcomes import _amount

    assert _amount(0.04 * 2**30) == "41.0 MiB"  # was "0.0 GiB"
    assert _amount(1) == "0.1 MiB"
    assert _amount(2.25 * 2**30) == "2.2 GiB"
