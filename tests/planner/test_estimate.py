"""`estimate()`: the JSON contract, consistency of the pieces, bad input, speed."""

from __future__ import annotations

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.schedule.actions import build_schedule
from fivefold.planner.schedule.simulation import closed_form_bubble, simulate
from fivefold.specs import ClusterSpec, ModelSpec, ParallelPlan, cluster_preset, model_preset
from fivefold.specs.flops import training_flops_per_token
from fivefold.units import GiB

LLAMA8 = model_preset("llama3-8b")
H100x8 = cluster_preset("dgx-h100", 8)
H100x64 = cluster_preset("dgx-h100", 64)
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "other", "total"}


def test_json_contract():
    plan = ParallelPlan(tp=2, pp=2, dp_shard=2, zero=1, grad_accum=4, recompute="selective")
    # The fused-kernel model, whose total is the sum of its tenants (fivefold's eager one
    # counts the gradients live at the peak and the optimizer step's own peak apart).
    est = estimate(LLAMA8, H100x8, plan, PlannerOptions())
    j = est.to_json()
    for key in (
        "fits",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "hfu",
        "bubble_fraction",
        "memory_gib",
        "hbm_gib",
        "worst_stage",
        "memory_per_stage_gib",
        "other_gib",
        "compute_time_s",
        "comm",
        "timeline",
        "precision",
        "plan",
        "model",
        "cluster",
    ):
        assert key in j, key
    assert set(j["memory_gib"]) == MEMORY_KEYS
    assert len(j["memory_per_stage_gib"]) == 2
    assert all(set(m) == MEMORY_KEYS for m in j["memory_per_stage_gib"])
    kinds = {c["kind"] for c in j["comm"]}
    assert {"tp", "pp", "dp", "zero-gather"} <= kinds
    for c in j["comm"]:
        assert set(c) == {"kind", "link", "link_model", "bytes_per_step", "time_s", "exposed_s"}
        assert c["link"] in ("nvlink", "ib") and 0 <= c["exposed_s"] <= c["time_s"] + 1e-12
    assert len(j["timeline"]) == 2
    events = j["timeline"][0]
    assert {e["kind"] for e in events} == {"F", "B"} and len(events) == 2 * 4
    assert set(events[0]) == {"kind", "microbatch", "chunk", "start_s", "end_s"}
    assert j["plan"] == plan.to_dict() and j["precision"] == "bf16-mixed"
    assert j["hbm_gib"] == pytest.approx(80.0)
    total = j["memory_gib"]
    parts = sum(total[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    assert total["total"] == pytest.approx(parts)
    assert sum(j["other_gib"].values()) == pytest.approx(total["other"])


def test_throughput_mfu_and_hfu_are_consistent():
    plan = ParallelPlan(tp=8, dp_shard=8, zero=1, grad_accum=4, recompute="full")
    est = estimate(LLAMA8, H100x64, plan)
    tokens = plan.global_batch * LLAMA8.seq_len
    assert est.tokens_per_s == pytest.approx(tokens / est.step_time_s)
    peak = 989.4e12 * 64
    model_flops = training_flops_per_token(LLAMA8) * tokens
    assert est.mfu == pytest.approx(model_flops / (est.step_time_s * peak))
    # fivefold's runtime recomputes with torch.utils.checkpoint's early stop
    assert est.options.checkpoint_early_stop
    hw = training_flops_per_token(LLAMA8, recompute="full", early_stop=True) * tokens
    assert est.hfu == pytest.approx(hw / (est.step_time_s * peak))
    assert est.hfu > est.mfu


def test_step_is_pipeline_plus_tail():
    plan = ParallelPlan(dp_shard=8, zero=2, grad_accum=3)
    est = estimate(LLAMA8, H100x8, plan)
    c = est.stage_costs
    per_microbatch = c.forward_s[0] + c.backward_input_s[0] + c.backward_weight_s[0]
    b = est.breakdown_s
    assert b["compute_s"] + b["in_stage_comm_s"] == pytest.approx(3 * per_microbatch)
    tail = b["dp_grad_exposed_s"] + b["param_gather_exposed_s"] + b["optimizer_s"]
    # fivefold's runtime all-reduces the token count and the loss every step
    assert b["runtime_sync_s"] > 0
    assert est.step_time_s == pytest.approx(3 * per_microbatch + tail + b["runtime_sync_s"])


def test_pipeline_uses_the_schedule_simulation():
    plan = ParallelPlan(pp=4, dp_shard=2, zero=1, grad_accum=8)
    est = estimate(LLAMA8, H100x8, plan)
    sim = simulate(build_schedule("1f1b", 4, 1, 8), est.stage_costs)
    critical_idle = sim.step_time_s - max(sim.busy_s)
    assert est.bubble_fraction == pytest.approx(critical_idle / sim.step_time_s)
    assert est.peak_inflight == [4, 3, 2, 1]
    # Nearly uniform stages: close to the closed form (p-1)/(m+p-1).
    assert est.bubble_fraction == pytest.approx(closed_form_bubble(4, 8), abs=0.03)
    analytic = estimate(LLAMA8, H100x8, plan, pipeline="analytic")
    # The first stage also runs the embedding (its backward writes the [V, h] gradient), the
    # last the head: the closed form for unequal stages is within 2 % of the simulation.
    assert analytic.step_time_s == pytest.approx(est.step_time_s, rel=0.02)


@pytest.mark.parametrize(
    "schedule,vpp,m",
    [("gpipe", 1, 8), ("interleaved-1f1b", 2, 8), ("zbv", 2, 8), ("dualpipev", 2, 8)],
)
def test_every_schedule_estimates(schedule, vpp, m):
    plan = ParallelPlan(pp=4, vpp=vpp, schedule=schedule, dp_shard=2, zero=1, grad_accum=m)
    est = estimate(LLAMA8, H100x8, plan)
    analytic = estimate(LLAMA8, H100x8, plan, pipeline="analytic")
    assert est.step_time_s > 0 and len(est.memory) == 4
    assert analytic.step_time_s == pytest.approx(est.step_time_s, rel=0.05)
    if schedule == "gpipe":
        assert est.peak_inflight == [m] * 4


def test_more_recompute_less_memory_more_time():
    base = ParallelPlan(dp_shard=8, zero=3, micro_batch=2)
    times, acts = [], []
    for policy in ("none", "selective", "full"):
        est = estimate(LLAMA8, H100x8, base.with_(recompute=policy))
        times.append(est.step_time_s)
        acts.append(est.worst_memory.activations)
    assert times[0] < times[1] < times[2]
    assert acts[0] > acts[1] > acts[2]


def test_fits_flag_against_hbm():
    big = estimate(model_preset("llama3-70b"), H100x8, ParallelPlan(dp_replicate=8))
    assert not big.fits  # 70B replicated: > 1 TB of state per GPU
    assert big.to_json()["memory_gib"]["total"] > 1000
    small = estimate(model_preset("small"), H100x8, ParallelPlan(dp_replicate=8))
    assert small.fits and small.worst_memory.total < 80 * GiB


def test_options_change_the_right_terms():
    plan = ParallelPlan(tp=8, dp_shard=8, zero=1, grad_accum=4)
    exposed = estimate(LLAMA8, H100x64, plan)
    overlap = estimate(LLAMA8, H100x64, plan, PlannerOptions(tp_comm_overlap=True))
    tp = {c.kind: c for c in exposed.comm}["tp"]
    tp_overlap = {c.kind: c for c in overlap.comm}["tp"]
    assert tp.exposed_s == pytest.approx(tp.time_s)
    assert tp_overlap.exposed_s < tp.exposed_s
    assert overlap.step_time_s < exposed.step_time_s


def test_efficiency_scales_compute():
    plan = ParallelPlan(dp_replicate=8)
    slow = EfficiencyModel(gemm_peak_fraction=(("hopper", 0.4),), layer_overhead_s=0.0)
    fast = EfficiencyModel(gemm_peak_fraction=(("hopper", 0.8),), layer_overhead_s=0.0)
    m = model_preset("small")
    a = estimate(m, H100x8, plan, efficiency=slow).compute_time_s
    b = estimate(m, H100x8, plan, efficiency=fast).compute_time_s
    assert a > b


BAD = [
    (ParallelPlan(tp=3), H100x8, "multiply"),
    (ParallelPlan(tp=16, dp_shard=4, zero=1), H100x64, "divide the 8 GPUs"),
    (ParallelPlan(pp=64, grad_accum=64), H100x64, "exceed model.layers"),
    (ParallelPlan(dp_shard=8), H100x8, "stage 0 shards nothing"),
    (ParallelPlan(dp_replicate=8, ep=2), H100x8, "ep"),
    (ParallelPlan(dp_replicate=8, precision="int4"), H100x8, "precision"),
    (ParallelPlan(dp_replicate=8), ClusterSpec(gpu="tpu-v9"), "not in the catalog"),
    (ParallelPlan(), ClusterSpec(gpu="cpu", gpus_per_node=1), "unknown peak"),
    (ParallelPlan(dp_replicate=8, micro_batch=0), H100x8, "micro_batch"),
]


@pytest.mark.parametrize("plan,cluster,message", BAD)
def test_bad_inputs(plan, cluster, message):
    with pytest.raises(ConfigError, match=message):
        estimate(LLAMA8, cluster, plan)


def test_bad_model_and_options():
    with pytest.raises(ConfigError, match=r"model\.layers"):
        estimate(ModelSpec(layers=0), H100x8, ParallelPlan(dp_replicate=8))
    with pytest.raises(ConfigError, match=r"model\.hidden"):
        estimate(ModelSpec(hidden=-64), H100x8, ParallelPlan(dp_replicate=8))
    with pytest.raises(ConfigError, match="attention_kernel"):
        estimate(LLAMA8, H100x8, ParallelPlan(dp_replicate=8), PlannerOptions(attention_kernel="x"))
    with pytest.raises(ConfigError, match="pipeline"):
        estimate(LLAMA8, H100x8, ParallelPlan(dp_replicate=8), pipeline="guess")


def _calls_of(fn) -> int:
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(fn)
    return pstats.Stats(profile).total_calls


def test_analytic_estimate_does_no_more_work_for_more_micro_batches():
    """The search's estimate (`pipeline="analytic"`) costs the same number of Python calls at
    64 and at 1024 micro-batches: it never walks a per-micro-batch action list (counted calls,
    not time)."""
    m = model_preset("llama3-405b")
    cluster = cluster_preset("dgx-h100", 16384)
    plan = ParallelPlan(tp=8, pp=16, dp_shard=128, zero=1, grad_accum=64)
    opts = PlannerOptions()
    estimate(m, cluster, plan, opts, pipeline="analytic")  # warm the per-layer caches
    calls = [
        _calls_of(
            lambda a=a: estimate(m, cluster, plan.with_(grad_accum=a), opts, pipeline="analytic")
        )
        for a in (64, 1024)
    ]
    assert calls[1] <= calls[0] * 1.05


def test_parameter_gather_hides_behind_first_forward_and_warm_up():
    """ZeRO-1 parameter all-gather (hand-derived from the stage costs): rank r of a 1F1B pipeline
    hides it behind its first forward and the r chunk forwards it waits for before that."""
    from fivefold.planner.memory.model_states import chunk_layers
    from fivefold.planner.rates.efficiency import efficiency_model
    from fivefold.planner.step_time.chunk_costs import chunk_costs_of
    from fivefold.planner.step_time.layer_costs import layer_cost_key
    from fivefold.planner.step_time.rank_tail import rank_tails
    from fivefold.specs.partition import stage_layer_counts

    model = model_preset("llama3-70b").with_(seq_len=2048)
    cluster = cluster_preset("dgx-h100", 128)  # dp groups of tp = 8: one GPU per node
    plan = ParallelPlan(tp=8, sp=True, pp=4, dp_shard=4, zero=1, grad_accum=8)
    opts, eff = PlannerOptions(), efficiency_model()
    counts = stage_layer_counts(model, 4)
    sigs = [(*chunk_layers(model, counts, c), c == 0, c == 3) for c in range(4)]
    costs = [chunk_costs_of(model, layer_cost_key(plan), cluster, eff, opts, *s) for s in sigs]
    tails = rank_tails(model, plan, cluster, eff, opts, sigs, costs)
    mean_forward = sum(c.forward_s for c in costs) / 4
    for rank, tail in enumerate(tails):
        window = costs[rank].forward_s + rank * mean_forward
        assert tail.gather_exposed_s == pytest.approx(max(0.0, tail.gather_time_s - window))
    assert tails[0].gather_exposed_s > 0.0  # the first rank cannot hide the whole gather
    assert tails[3].gather_exposed_s < tails[0].gather_exposed_s


def test_bubble_fraction_and_seconds_are_one_figure():
    """zbv v=2 on uneven chunks: the fraction was mean idle, the seconds the busiest rank's idle."""
    plan = ParallelPlan(pp=4, vpp=2, schedule="zbv", dp_shard=4, zero=1, grad_accum=16)
    est = estimate(LLAMA8, cluster_preset("dgx-h100", 16), plan)
    b = est.breakdown_s
    pipeline_s = b["compute_s"] + b["in_stage_comm_s"] + b["pipeline_bubble_s"]
    assert b["pipeline_bubble_s"] == pytest.approx(est.bubble_fraction * pipeline_s, rel=1e-12)
    assert min(b.values()) >= 0.0


def test_no_negative_rounding_residue_in_the_breakdown():
    """PP1 DP16 on llama3-8b left in_stage_comm_s = busy - compute = -4.4e-16 (float residue)."""
    plan = ParallelPlan(dp_shard=16, zero=1, grad_accum=4)
    est = estimate(LLAMA8, cluster_preset("dgx-h100", 16), plan)
    assert est.breakdown_s["in_stage_comm_s"] == 0.0  # no TP/CP/EP: nothing inside the stage
    assert est.breakdown_s["pipeline_bubble_s"] == 0.0


def _tails(model, plan, cluster):
    from fivefold.planner.memory.model_states import chunk_layers
    from fivefold.planner.rates.efficiency import efficiency_model
    from fivefold.planner.step_time.chunk_costs import chunk_costs_of
    from fivefold.planner.step_time.layer_costs import layer_cost_key
    from fivefold.planner.step_time.rank_tail import rank_tails
    from fivefold.specs.partition import stage_layer_counts

    opts, eff = PlannerOptions(), efficiency_model()
    n = plan.pp * plan.vpp
    counts = stage_layer_counts(model, n)
    sigs = [(*chunk_layers(model, counts, c), c == 0, c == n - 1) for c in range(n)]
    costs = [chunk_costs_of(model, layer_cost_key(plan), cluster, eff, opts, *s) for s in sigs]
    return rank_tails(model, plan, cluster, eff, opts, sigs, costs)


def test_tied_embeddings_add_an_all_reduce_between_first_and_last_stage():
    """The two copies' gradients are summed over the first and last stage: V x h / dp_shard
    elements per rank (a 2-rank all-reduce moves its size), on those two ranks only; none
    under a V schedule, whose ends share a rank."""
    from fivefold.planner.rates.efficiency import efficiency_model
    from fivefold.planner.step_time.comm import ib_bandwidth

    untied = LLAMA8
    tied = LLAMA8.with_(tied_embeddings=True)
    cluster = cluster_preset("dgx-h100", 32)
    plan = ParallelPlan(pp=4, dp_shard=8, zero=1, grad_accum=8, precision="bf16-mixed")
    before, after = _tails(untied, plan, cluster), _tails(tied, plan, cluster)
    size = LLAMA8.vocab * LLAMA8.hidden / 8 * 2  # bf16-mixed's 2-byte gradients, 1/dp_shard
    ib = ib_bandwidth(cluster, efficiency_model())  # stages 0 and 3 sit 24 ranks apart: IB
    for rank in (0, 3):
        assert after[rank].grad_bytes - before[rank].grad_bytes == pytest.approx(size)
        extra = after[rank].grad_exposed_s - before[rank].grad_exposed_s
        assert size / ib <= extra < size / ib + 1e-3
    for rank in (1, 2):
        assert after[rank] == before[rank]
    v = plan.with_(schedule="zbv", vpp=2, grad_accum=16)
    assert _tails(tied, v, cluster) == _tails(untied, v, cluster)
