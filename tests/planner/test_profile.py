"""Device profiles (`fivefold.specs.profile`): round trip, validation, and the planner's times from
a synthetic profile against hand-derived values."""

from __future__ import annotations

import math
import tomllib

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time import comm as C
from fivefold.planner.step_time.compute import (
    ComputeOptions,
    head_work,
    layer_work,
    optimizer_step_s,
)
from fivefold.specs.cluster import profile_cluster
from fivefold.specs.flops import (
    attention_score_flops_per_token,
    layer_matmul_flops_per_token,
    training_flops_per_token,
)
from fivefold.specs.hardware import profile_device
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset
from fivefold.specs.profile import COLLECTIVES, Matmul, parse_profile, read_profile

EFF = EfficiencyModel()
TINY = model_preset("tiny")  # h 64, 4 heads (2 kv) of 16, SwiGLU 176, 2 layers, V 4096, s 128
GEMM = 1e10  # FLOP/s, every shape
ATT_F, ATT_B = 2e9, 1e9
BW = {"elementwise_forward": 4e9, "elementwise_backward": 2e9, "loss_forward": 1e9}
BW |= {"loss_backward": 5e8, "optimizer": 3e9}
OVER_F, OVER_B = 1e-4, 3e-4
MOE_F, MOE_B, TP_F, TP_B, FSDP_F, FSDP_B = 5e-4, 9e-4, 2e-4, 4e-4, 3e-5, 7e-5
REP_F, REP_B, SHARD_F, SHARD_B = 1e-5, 6e-5, 2e-5, 5e-5  # ZeRO-0 and ZeRO-1/2 units
EP_F, EP_B = 6e-4, 8e-4  # a MoE layer under expert parallelism


def synthetic(cores: int = 2) -> dict:
    """A profile whose every rate is flat, measured at 1 and `cores` threads (the same rates:
    one thread per rank in the tests below)."""
    rows: dict[str, list] = {k: [] for k in ("matmul", "attention", "bandwidth", "overhead")}
    for threads in sorted({1, cores}):
        for m, n, k, layout in ((512, 64, 64, "nt"), (4096, 4096, 4096, "nn")):
            rows["matmul"].append(
                dict(dtype="fp32", threads=threads, m=m, n=n, k=k, layout=layout, flops_per_s=GEMM)
            )
        rows["attention"].append(
            dict(
                dtype="fp32", threads=threads, batch=4, heads=4, kv_heads=2, seq=128, head_dim=16,
                cp=1, forward_flops_per_s=ATT_F, backward_flops_per_s=ATT_B,
            )
        )  # fmt: skip
        rows["bandwidth"] += [
            dict(kind=k, threads=threads, processes=1, bytes_per_s=v) for k, v in BW.items()
        ]
        rows["overhead"].append(
            dict(
                threads=threads, layer_forward_s=OVER_F, layer_backward_s=OVER_B,
                moe_forward_s=MOE_F, moe_backward_s=MOE_B, tp_forward_s=TP_F,
                tp_backward_s=TP_B, fsdp_forward_s=FSDP_F, fsdp_backward_s=FSDP_B,
                replicate_forward_s=REP_F, replicate_backward_s=REP_B,
                shard_forward_s=SHARD_F, shard_backward_s=SHARD_B,
                ep_forward_s=EP_F, ep_backward_s=EP_B,
            )
        )  # fmt: skip
    collective = [
        dict(op=op, ranks=2, world=2, gap_s=0.0, alpha_s=1e-4, beta_bytes_per_s=1e9)
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
    ]
    sample = [
        dict(
            op="all_reduce", ranks=2, world=2, gap_s=0.0, size_bytes=1024, time_s=1e-4,
            algbw_bytes_per_s=1.024e7, busbw_bytes_per_s=1.024e7,
        )
    ]  # fmt: skip
    device = dict(
        name="Test CPU", kind="cpu", cores=cores, memory_bytes=8 * 2**30, backend="gloo", ranks=2
    )
    return dict(format=4, device=device, **rows, collective=collective, collective_sample=sample)


def without_overheads(tmp_path, *kinds: str):
    """(free, paid): profiles written under `tmp_path` that differ only in the overhead rows'
    `{kind}_forward_s` / `{kind}_backward_s` extras, zero in `free`, as `synthetic` in `paid`."""
    data = synthetic()
    for row in data["overhead"]:
        row.update({f"{k}_{p}_s": 0.0 for k in kinds for p in ("forward", "backward")})
    free, paid = tmp_path / "free.toml", tmp_path / "paid.toml"
    free.write_text(parse_profile(data).to_toml())
    paid.write_text(parse_profile(synthetic()).to_toml())
    return free, paid


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.toml"
    path.write_text(parse_profile(synthetic()).to_toml())
    return path


def test_round_trip(profile_path):
    prof = read_profile(profile_path)
    again = parse_profile(tomllib.loads(prof.to_toml()))
    assert again == prof
    assert prof.matmul[0] == Matmul("fp32", 1, 512, 64, 64, "nt", GEMM)
    assert len(prof.collective) == 5 and prof.collective_sample[0].size_bytes == 1024


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["matmul"][0].update(flops_per_s=-1.0), "matmul[0].flops_per_s"),
        (lambda d: d["matmul"][1].update(layout="xx"), "matmul[1].layout"),
        (lambda d: d["bandwidth"][0].pop("bytes_per_s"), "bandwidth[0].bytes_per_s"),
        (lambda d: d["device"].update(cores="two"), "device.cores"),
        (lambda d: d["collective"][0].update(ranks=1), "collective[0].ranks"),
        (lambda d: d.update(format=9), "format"),
        (lambda d: d.update(overhead=[]), "[[overhead]]"),
    ],
)
def test_bad_profile_names_the_field(edit, field):
    data = synthetic()
    edit(data)
    with pytest.raises(ConfigError, match=re_escape(field)):
        parse_profile(data)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_missing_profile_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="fivefold calibrate"):
        profile_cluster(tmp_path / "nope.toml")


def test_device_peak_is_the_best_measured_rate_per_rank_share(profile_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = profile_device(profile_path, 1)  # 2 threads on 2 cores
    assert one.peak("fp32") == GEMM and one.rank_profile.threads == 2
    assert "measured" in one.source
    four = profile_device(profile_path, 4)  # 1 thread each, 4 ranks share 2 cores
    assert four.rank_profile.share == 0.5 and four.peak("fp32") == GEMM / 2
    assert four.hbm_bytes == 2 * 2**30
    with pytest.raises(ConfigError, match="no bf16 matmul measurement"):
        one.peak("bf16")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torch's threads, as the user set them
    assert profile_device(profile_path, 2).rank_profile.share == 0.5


def test_gemm_rate_is_a_function_of_shape_interpolated_in_log_space(tmp_path):
    data = synthetic()
    for row in data["matmul"]:
        row["flops_per_s"] = 1e9 if row["m"] == 512 else 1e11
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    measured = rates_for(profile_device(path, 2))
    assert measured.gemm_flops_per_s(512, 64, 64, "fp32", "nt") == 1e9  # exact shape
    # (1024, 1024, 256) from (512, 64, 64) at 1e9 and (4096, 4096, 4096) at 1e11: distances^2
    # in log space ln2^2 + ln16^2 + ln4^2 and ln4^2 + ln4^2 + ln16^2, log rates weighted by
    # their inverses. No "tn" rows: every layout's rows are used.
    d_low = math.log(2) ** 2 + math.log(16) ** 2 + math.log(4) ** 2
    d_high = 2 * math.log(4) ** 2 + math.log(16) ** 2
    w_low, w_high = 1 / d_low, 1 / d_high
    expected = math.exp((w_low * math.log(1e9) + w_high * math.log(1e11)) / (w_low + w_high))
    got = measured.gemm_flops_per_s(1024, 1024, 256, "fp32", "tn")
    assert got == pytest.approx(expected)
    # beyond the measured shapes: clamped to their range, the edge's rate
    assert measured.gemm_flops_per_s(10**5, 10**5, 10**5, "fp32", "tn") == 1e11
    assert measured.gemm_flops_per_s(1, 1, 1, "fp32", "tn") == 1e9
    # The same layout is preferred: the only "nn" row sets every "nn" rate.
    assert measured.gemm_flops_per_s(1, 1, 1, "fp32", "nn") == 1e11
    # An unmeasured dtype reads the bf16 rows, else fp32's.
    assert measured.gemm_flops_per_s(512, 64, 64, "fp8", "nt") == 1e9


def test_a_cuda_profile_is_each_rank_s_own_gpu(tmp_path):
    data = synthetic(cores=16)
    data["device"]["kind"] = "cuda"
    for table in ("matmul", "attention", "bandwidth", "overhead"):
        data[table] = [r for r in data[table] if r["threads"] == 1]
    path = tmp_path / "gpu.toml"
    path.write_text(parse_profile(data).to_toml())
    four = profile_device(path, 4)
    assert four.rank_profile.share == 1.0 and four.peak("fp32") == GEMM  # no core share
    assert four.hbm_bytes == data["device"]["memory_bytes"]  # HBM not divided


def test_the_previous_format_is_read_and_older_ones_named(tmp_path):
    data = synthetic()
    data["format"] = 4
    assert parse_profile(data).matmul  # format 4: the same tables
    data["format"] = 3
    with pytest.raises(ConfigError, match="reads formats 4, 5; re-run `fivefold calibrate`"):
        parse_profile(data)


def test_layer_times_from_the_profile_by_hand(profile_path):
    plan = ParallelPlan(micro_batch=4, precision="fp32")
    device = profile_device(profile_path, 2)  # one thread per rank, the whole rate
    tokens = 4 * 128
    e = 4
    gemm_flops = tokens * layer_matmul_flops_per_token(TINY, False)
    attn = tokens * attention_score_flops_per_token(TINY, 128)
    h, q, kv, f = 64, 64, 32, 176
    elem = tokens * (2 * 2 * e * h + 2 * 3 * e * h + 2 * e * (q + kv) + 3 * e * f)
    over_f, over_b = OVER_F + REP_F, OVER_B + REP_B  # ZeRO-0: the block is a `replicate` unit
    forward = gemm_flops / GEMM + attn / ATT_F + elem / BW["elementwise_forward"] + over_f
    backward = gemm_flops / GEMM + 2 * attn / ATT_B + 2 * elem / BW["elementwise_backward"] + over_b
    work = layer_work(TINY, plan, device, EFF)
    assert work.forward_s == pytest.approx(forward)
    assert work.backward_input_s == pytest.approx(backward)
    assert work.backward_weight_s == pytest.approx(gemm_flops / GEMM)
    # Full recompute repeats the forward less the skipped w2 (checkpoint early stop).
    full = layer_work(
        TINY,
        plan.with_(recompute="full"),
        device,
        EFF,
        opts=ComputeOptions(checkpoint_early_stop=True),
    )
    w2 = 2 * tokens * h * f / GEMM
    assert full.recompute_s == pytest.approx(forward - w2)
    sel = layer_work(TINY, plan.with_(recompute="selective"), device, EFF)
    assert sel.recompute_s == pytest.approx(attn / ATT_F)


def test_head_and_optimizer_from_the_profile_by_hand(profile_path):
    plan = ParallelPlan(micro_batch=4, precision="fp32")
    device = profile_device(profile_path, 2)
    tokens, v, h = 512, 4096, 64
    gemm = 2 * tokens * v * h / GEMM
    norm = tokens * h * 4 / BW["elementwise_forward"]
    head = head_work(TINY, plan, device, EFF)
    assert head.forward_s == pytest.approx(gemm + 10 * tokens * v / BW["loss_forward"] + norm)
    norm_b = 2 * tokens * h * 4 / BW["elementwise_backward"]
    assert head.backward_input_s == pytest.approx(
        gemm + 14 * tokens * v / BW["loss_backward"] + norm_b
    )
    # fp32 AdamW: 2 x 8 bytes of state, 4 of gradient, 4 of parameter; clipping 3 x 4.
    assert optimizer_step_s(1e6, plan, device, EFF) == pytest.approx(1e6 * 36 / BW["optimizer"])


def test_collectives_use_the_fitted_alpha_beta(profile_path):
    cluster = profile_cluster(profile_path, 4)
    link = C.group_link(cluster, 2, 1, EFF)
    assert link.kind == "gloo"
    words = "p2p, fitted to gloo on this machine (fivefold calibrate)"
    assert C.link_model(link, "p2p", 2) == words  # what the breakdown says of its pricing
    s = 1e6
    assert C.all_reduce_time_s(s, 2, link) == pytest.approx(1e-4 + s / 1e9)
    assert C.all_gather_time_s(s, 2, link) == pytest.approx(1e-4 + s / 1e9)
    assert C.p2p_time_s(s, C.pipeline_link(cluster, ParallelPlan(pp=2), EFF)) == pytest.approx(
        1e-4 + s / 1e9
    )
    # Four ranks, measured on two: alpha x 3 steps, bus bandwidth kept (factor 1 -> 1.5).
    assert C.all_reduce_time_s(s, 4, link) == pytest.approx(3e-4 + s / (1e9 * 1.0 / 1.5))
    assert C.all_to_all_time_s(s, 4, link) == pytest.approx(3e-4 + s / (1e9 * 0.5 / 0.75))


def test_estimate_on_a_profile_predicts_step_time_and_uses_the_measured_peak(profile_path):
    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(dp_shard=2, zero=3, micro_batch=4, grad_accum=2, recompute="full")
    plan = plan.with_(precision="fp32")
    est = estimate(TINY, cluster, plan)
    assert est.step_time_s > 0
    tokens = plan.global_batch * TINY.seq_len
    assert est.mfu == pytest.approx(
        training_flops_per_token(TINY) * tokens / (est.step_time_s * GEMM * 2)
    )
    hw = training_flops_per_token(TINY, recompute="full", early_stop=True) * tokens
    assert est.hfu == pytest.approx(hw / (est.step_time_s * GEMM * 2))
    # A CPU has no CUDA context or allocator fragmentation.
    assert est.options.cuda_context_bytes == 0 and est.options.checkpoint_early_stop
    assert not est.options.dp_overlap  # gloo shares the cores: nothing hides behind compute


def test_recipe_cluster_profile_and_plan_cli(profile_path, capsys):
    from fivefold.cli.main import main
    from fivefold.specs.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {
            "model": {"preset": "tiny"},
            "cluster": {"profile": str(profile_path)},
            "plan": {"dp_replicate": 2, "precision": "fp32"},
        },
        default_world=2,
    )
    assert recipe.cluster.world_size == 2 and recipe.cluster.device.rank_profile is not None
    code = main(
        ["plan", "estimate", "--model", "tiny", "--cluster", str(profile_path), "--gpus", "2",
         "--dp", "2", "--mbs", "4", "--global-batch", "8", "--precision", "fp32", "--json"]
    )  # fmt: skip
    assert code == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0 and out["cluster"]["profile"] == str(profile_path)


def test_plan_says_when_ranks_share_the_cores(profile_path, capsys):
    """Four ranks on the profile's two cores, pipelined: the step is shorter than its parts
    added up, and `fivefold plan` says by how much (the breakdown's core_sharing_s)."""
    from fivefold.cli.main import main

    args = ["plan", "estimate", "--model", "tiny", "--cluster", str(profile_path), "--gpus", "4",
            "--pp", "2", "--dp", "2", "--zero", "1", "--mbs", "1", "--grad-accum", "4",
            "--precision", "fp32"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    import json

    sharing = json.loads(capsys.readouterr().out)["breakdown_s"]["core_sharing_s"]
    assert sharing < 0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"the step is {-sharing * 1e3:,.1f} ms shorter" in out


def test_layer_overhead_by_layer_kind(profile_path):
    """A MoE layer has its own fixed cost; tensor parallelism and a ZeRO-3 unit add theirs; four
    one-thread ranks on two cores get half the machine, so every fixed second takes two."""
    measured = rates_for(profile_device(profile_path, 2))
    assert measured.layer_overhead_s() == pytest.approx((OVER_F, OVER_B))
    assert measured.layer_overhead_s(moe=True) == pytest.approx((MOE_F, MOE_B))
    both = measured.layer_overhead_s(tp=True, zero=3)
    assert both == pytest.approx((OVER_F + TP_F + FSDP_F, OVER_B + TP_B + FSDP_B))
    assert measured.layer_overhead_s(zero=0) == pytest.approx((OVER_F + REP_F, OVER_B + REP_B))
    for zero in (1, 2):
        assert measured.layer_overhead_s(zero=zero) == pytest.approx(
            (OVER_F + SHARD_F, OVER_B + SHARD_B)
        )
    two = measured.layer_overhead_s(moe=True, zero=1, units=2)
    assert two == pytest.approx((MOE_F + 2 * SHARD_F, MOE_B + 2 * SHARD_B))
    ep = measured.layer_overhead_s(moe=True, ep=True)
    assert ep == pytest.approx((MOE_F + EP_F, MOE_B + EP_B))
    assert measured.layer_overhead_s(ep=True) == pytest.approx((OVER_F, OVER_B))  # dense layer
    crowded = rates_for(profile_device(profile_path, 4))
    assert crowded.layer_overhead_s(moe=True, tp=True) == pytest.approx(
        (2 * (MOE_F + TP_F), 2 * (MOE_B + TP_B))
    )


def test_tensor_parallel_layers_carry_their_extra(tmp_path):
    """The same TP 2 layer on two profiles that differ only in the TP extra: the layer's forward
    and input-gradient backward differ by exactly that extra."""
    free, paid = without_overheads(tmp_path, "tp")
    plan = ParallelPlan(micro_batch=4, tp=2, precision="fp32")
    a = layer_work(TINY, plan, profile_device(free, 2), EFF)
    b = layer_work(TINY, plan, profile_device(paid, 2), EFF)
    assert b.forward_s - a.forward_s == pytest.approx(TP_F)
    assert b.backward_input_s - a.backward_input_s == pytest.approx(TP_B)


@pytest.mark.parametrize(
    ("zero", "ep", "moe", "units", "extra"),
    [
        (0, 1, False, 1, (REP_F, REP_B)),
        (1, 1, False, 1, (SHARD_F, SHARD_B)),
        (2, 1, False, 1, (SHARD_F, SHARD_B)),
        (3, 1, False, 1, (FSDP_F, FSDP_B)),
        (1, 2, True, 2, (SHARD_F, SHARD_B)),  # EP experts are a unit of their own
        (1, 1, True, 1, (SHARD_F, SHARD_B)),
    ],
)
def test_data_parallel_unit_hooks_by_hand(tmp_path, zero, ep, moe, units, extra):
    """Each block is one data-parallel unit of the plan's ZeRO level (two under EP: the experts
    apart): two profiles that differ only in the units' extra give layer times that differ by
    exactly units x that extra, forward and input-gradient backward."""
    free, paid = without_overheads(tmp_path, "fsdp", "replicate", "shard")
    spec = model_preset("tiny-moe") if moe else TINY
    plan = ParallelPlan(dp_shard=2, zero=zero, ep=ep, micro_batch=4, precision="fp32")
    if zero == 0:
        plan = ParallelPlan(dp_replicate=2, ep=ep, micro_batch=4, precision="fp32")
    a = layer_work(spec, plan, profile_device(free, 2), EFF, moe=moe)
    b = layer_work(spec, plan, profile_device(paid, 2), EFF, moe=moe)
    assert b.forward_s - a.forward_s == pytest.approx(units * extra[0])
    assert b.backward_input_s - a.backward_input_s == pytest.approx(units * extra[1])


def test_zero3_with_pipelining_communicates_once_per_step(profile_path):
    """torch's pipeline stages keep a ZeRO-3 chunk gathered for the step and reduce-scatter
    after the last backward: the same communication as ZeRO-1 under the same pipeline."""
    cluster = profile_cluster(profile_path, 4)
    base = ParallelPlan(pp=2, dp_shard=2, micro_batch=1, grad_accum=4, precision="fp32")
    z3 = estimate(TINY, cluster, base.with_(zero=3))
    z1 = estimate(TINY, cluster, base.with_(zero=1))
    assert z3.breakdown_s["in_stage_comm_s"] == pytest.approx(0.0, abs=1e-12)  # no layer gathers
    assert z3.step_time_s == pytest.approx(z1.step_time_s)
    kinds = {c.kind: c.bytes_per_step for c in z3.comm}
    assert kinds == pytest.approx({c.kind: c.bytes_per_step for c in z1.comm})
    # Without pipelining ZeRO-3 gathers every layer in forward and backward of each micro-batch.
    flat = estimate(TINY, cluster, base.with_(pp=1, dp_shard=4, zero=3))
    assert flat.breakdown_s["in_stage_comm_s"] > 0


def test_zero3_pays_fsdp_copies_by_hand(profile_path):
    """Each ZeRO-3 gather is copied out into the parameters and each gradient reduce-scatter's
    input is copied in: 2 bytes moved per byte, at the element-wise bandwidth."""
    from fivefold.planner.options import PlannerOptions
    from fivefold.planner.step_time.layer_costs import layer_cost_key, layer_costs

    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(dp_shard=2, zero=3, micro_batch=4, precision="fp32")
    opts = PlannerOptions.for_device(cluster.device)
    lc = layer_costs(TINY, layer_cost_key(plan), cluster, EFF, opts, False)
    params = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 176 + 2 * 64  # attention, SwiGLU, norms
    assert lc.gather_copy_s == pytest.approx(2 * params * 4 / BW["elementwise_forward"])
    assert lc.reduce_copy_s == pytest.approx(lc.gather_copy_s)


def test_collectives_measured_among_as_many_processes_as_the_run(tmp_path):
    """A 2-rank group measured alone and among 4 processes on 2 cores: a 2-rank run reads the
    first, a 4-rank run (its 2-rank groups share the cores with the other pair) the second."""
    data = synthetic()
    data["device"]["ranks"] = 4
    data["collective"] = [
        dict(op=op, ranks=2, world=2, gap_s=0.0, alpha_s=1e-4, beta_bytes_per_s=1e9)
        for op in COLLECTIVES
    ] + [
        dict(op=op, ranks=2, world=4, gap_s=0.0, alpha_s=3e-4, beta_bytes_per_s=4e8)
        for op in COLLECTIVES
    ]
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    assert rates_for(profile_device(path, 2)).collective("all_gather", 2) == (1e-4, 1e9)
    assert rates_for(profile_device(path, 4)).collective("all_gather", 2) == (3e-4, 4e8)
    bad = synthetic()
    bad["collective"][0]["world"] = 1
    with pytest.raises(ConfigError, match=r"collective\[0\]\.world"):
        parse_profile(bad)


def test_collectives_interpolate_in_the_compute_gap(tmp_path):
    """Collectives measured back to back (gap 0) and after a 2 ms GEMM: a plan whose GEMM takes
    0.5 ms reads alpha and 1/beta a quarter of the way between, clamped beyond the ends; no gap
    given reads the longest measured."""
    data = synthetic()
    data["collective"] = [
        dict(op="all_gather", ranks=2, world=2, gap_s=0.0, alpha_s=1e-4, beta_bytes_per_s=1e9),
        dict(op="all_gather", ranks=2, world=2, gap_s=2e-3, alpha_s=9e-4, beta_bytes_per_s=5e8),
    ]
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    measured = rates_for(profile_device(path, 2))
    alpha, beta = measured.collective("all_gather", 2, 0.5e-3)
    assert alpha == pytest.approx(1e-4 + 0.25 * 8e-4)
    assert 1 / beta == pytest.approx(1e-9 + 0.25 * (2e-9 - 1e-9))
    assert measured.collective("all_gather", 2, 5e-3) == (9e-4, 5e8)
    assert measured.collective("all_gather", 2) == (9e-4, 5e8)
    assert measured.collective("all_gather", 2, 0.0) == (1e-4, 1e9)


def test_collectives_between_their_measured_sizes(tmp_path):
    """all_gather over 2 ranks measured at 1 and 16 MiB, back to back (2 and 20 ms) and after
    a 2 ms GEMM (4 and 24 ms): piecewise linear in log size / log time between the sizes,
    beyond the largest its time and the rest at the fitted bandwidth, the smallest's time
    below it, linear in the gap;
    a group size without samples reads the fitted line."""
    data = synthetic()
    data["collective"] = [
        dict(op="all_gather", ranks=2, world=2, gap_s=0.0, alpha_s=1e-4, beta_bytes_per_s=1e9),
        dict(op="all_gather", ranks=2, world=2, gap_s=2e-3, alpha_s=9e-4, beta_bytes_per_s=5e8),
    ]
    data["collective_sample"] = [
        dict(
            op="all_gather", ranks=2, world=2, gap_s=gap, size_bytes=size, time_s=t,
            algbw_bytes_per_s=size / t, busbw_bytes_per_s=size / t / 2,
        )
        for gap, size, t in [
            (0.0, 2**20, 2e-3), (0.0, 16 * 2**20, 20e-3),
            (2e-3, 2**20, 4e-3), (2e-3, 16 * 2**20, 24e-3),
        ]
    ]  # fmt: skip
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    rates = rates_for(profile_device(path, 2))
    back_to_back = rates.local_link(2, 0.0)
    mib = 2**20
    assert back_to_back.collective_s("all_gather", 4 * mib, 2) == pytest.approx(2e-3 * 10**0.5)
    beyond = 20e-3 + 16 * mib / 1e9  # the rest at the fitted bandwidth
    assert back_to_back.collective_s("all_gather", 32 * mib, 2) == pytest.approx(beyond)
    assert back_to_back.collective_s("all_gather", 64 * 1024, 2) == pytest.approx(2e-3)
    after = 4e-3 * 6**0.5
    quarter = rates.local_link(2, 0.5e-3).collective_s("all_gather", 4 * mib, 2)
    assert quarter == pytest.approx(2e-3 * 10**0.5 + 0.25 * (after - 2e-3 * 10**0.5))
    assert rates.local_link(2, None).collective_s("all_gather", 4 * mib, 2) == pytest.approx(after)
    # Four ranks, measured on two: alpha x 3 steps, bus bandwidth kept (factor 1/2 -> 3/4).
    four = rates.local_link(4, 0.0).collective_s("all_gather", 4 * mib, 4)
    assert four == pytest.approx(3e-4 + 4 * mib / (1e9 * 0.5 / 0.75))


def test_moe_routing_collectives_by_hand(profile_path):
    """fivefold's runtime adds to each MoE layer's forward an all-reduce of the load-balancing
    statistics (2E + 2 fp64) over the ranks with different tokens and, under EP, an all-to-all
    of the E per-expert counts (int64); both on the stage's critical path."""
    from dataclasses import replace

    from fivefold.planner.options import PlannerOptions
    from fivefold.planner.step_time.layer_costs import routing_sync_s

    moe = model_preset("tiny-moe")  # 4 experts
    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(dp_shard=2, zero=1, ep=2, micro_batch=2, precision="fp32")
    by_hand = (1e-4 + 80 / 1e9) + (1e-4 + 32 / 1e9)
    assert routing_sync_s(moe, plan, cluster, EFF) == pytest.approx(by_hand)
    eager = PlannerOptions.for_device(cluster.device)
    fused = replace(eager, runtime="fused")
    a = estimate(moe, cluster, plan, options=eager, efficiency=EFF)
    b = estimate(moe, cluster, plan, options=fused, efficiency=EFF)
    assert a.stage_costs.forward_s[0] - b.stage_costs.forward_s[0] == pytest.approx(
        moe.moe_layers * by_hand
    )


def test_dtensor_small_collectives_by_hand(profile_path):
    """Under TP2 + SP fivefold's runtime all-reduces each norm weight's gradient in the
    backward (2 per layer + the final norm), all-gathers again the attention's and the MLP's
    kept input shards in the backward (2 per layer, `sp_regathered_inputs`) and, in the
    vocabulary-parallel loss forward (one chunk here), the per-token fp32 maximum, then the
    sum of exponentials and the target logit stacked: the stage costs carry exactly these."""
    from dataclasses import replace

    from fivefold.planner.options import PlannerOptions

    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(tp=2, micro_batch=2, precision="fp32")
    eager = PlannerOptions.for_device(cluster.device)
    a = estimate(TINY, cluster, plan, options=eager, efficiency=EFF)
    b = estimate(TINY, cluster, plan, options=replace(eager, runtime="fused"), efficiency=EFF)
    tokens = 2 * 128
    loss = (1e-4 + tokens * 4 / 1e9) + (1e-4 + tokens * 8 / 1e9)
    norms = (2 * 2 + 1) * (1e-4 + 64 * 4 / 1e9)
    regathers = 2 * 2 * (1e-4 + tokens * 64 * 4 / 1e9)  # [2, 128, 64] fp32 gathered
    assert a.stage_costs.forward_s[0] - b.stage_costs.forward_s[0] == pytest.approx(loss)
    assert a.stage_costs.backward_input_s[0] - b.stage_costs.backward_input_s[0] == pytest.approx(
        norms + regathers
    )
    # a 2^19 vocabulary: 2^18 rows per rank, 2^25 logits a chunk, so two chunks of 128 tokens
    wide = TINY.with_(vocab=2**19)
    a = estimate(wide, cluster, plan, options=eager, efficiency=EFF)
    b = estimate(wide, cluster, plan, options=replace(eager, runtime="fused"), efficiency=EFF)
    loss = 2 * ((1e-4 + 128 * 4 / 1e9) + (1e-4 + 128 * 8 / 1e9))
    assert a.stage_costs.forward_s[0] - b.stage_costs.forward_s[0] == pytest.approx(loss)


def test_tp_sequence_collectives_by_hand(tmp_path):
    """TP2 + SP on a measured CPU, one layer of tiny at micro-batch 2 (256 tokens x 64 fp32 =
    64 KiB per sequence collective): forward 2 all-gathers and 2 reduce-scatters, backward the
    same and fivefold's 2 re-gathers; the reduce-scatters priced by their own fit, and each
    collective's DTensor host seconds (`Collective.host_s`) on top."""
    from fivefold.planner.options import PlannerOptions
    from fivefold.planner.step_time.layer_costs import layer_costs

    data = synthetic()
    fits = {"all_gather": (1e-4, 1e9, 3e-4), "reduce_scatter": (2e-4, 5e8, 5e-4)}
    for row in data["collective"]:
        if row["op"] in fits:
            row.update(zip(("alpha_s", "beta_bytes_per_s", "host_s"), fits[row["op"]], strict=True))
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    assert read_profile(path).collective[1].host_s == 3e-4  # written and read back
    cluster = profile_cluster(path, 2)
    plan = ParallelPlan(tp=2, micro_batch=2, precision="fp32")
    costs = layer_costs(TINY, plan, cluster, EFF, PlannerOptions.for_device(cluster.device), False)
    size = 2 * 128 * 64 * 4
    gather, scatter = 1e-4 + size / 1e9 + 3e-4, 2e-4 + size / 5e8 + 5e-4
    assert costs.tp_fwd_s == pytest.approx(2 * (gather + scatter))
    assert costs.tp_bwd_s == pytest.approx(2 * (gather + scatter) + 2 * gather)
    # a GPU (catalog link) counts no host seconds: the host runs ahead of the kernels
    assert C.group_link(profile_cluster(path, 2), 2, 1, EFF).host_s("all_gather", 2) == 3e-4
    gpu = C.Link("nvlink", 1e11, 1e-6, 8, 1e11, 2.5e10)
    assert gpu.host_s("all_gather", 2) == 0.0
    # the whole step: per layer (2 of tiny's) 2 pairs forward, 2 pairs and 2 re-gathers
    # backward, and the sequence-parallel region's ends (an all-gather each way) host-priced
    for row in data["collective"]:
        row["host_s"] = 0.0
    free = tmp_path / "free.toml"
    free.write_text(parse_profile(data).to_toml())
    paid, unpaid = (
        estimate(TINY, profile_cluster(f, 2), plan, efficiency=EFF).stage_costs
        for f in (path, free)
    )
    assert paid.forward_s[0] - unpaid.forward_s[0] == pytest.approx(2 * 2 * 8e-4 + 3e-4)
    assert paid.backward_input_s[0] - unpaid.backward_input_s[0] == pytest.approx(
        2 * (2 * 8e-4 + 2 * 3e-4) + 3e-4
    )


def _grouped_rows(rate_by_groups: dict[int, float]) -> list[dict]:
    """tiny-moe's expert projections (1024 routed rows at micro-batch 4, 64 x 64) measured at
    the given rates, every pass, one thread (the synthetic profile's rows repeat at 2)."""
    return [
        dict(dtype="fp32", threads=t, groups=g, tokens=1024, n=64, k=64, layout=layout,
             flops_per_s=rate)
        for t in (1, 2) for g, rate in rate_by_groups.items() for layout in ("nt", "nn", "tn")
    ]  # fmt: skip


def test_grouped_expert_matmuls_by_hand(tmp_path):
    """A MoE layer's routed experts are three `_grouped_mm` calls (w1, w3, w2) over tokens x
    top_k rows: 1024 rows x 64 x 64 each for tiny-moe at micro-batch 4, 2 x 1024 x 64 x 64
    FLOPs per pass. Timed at the measured grouped rate of the rank's number of experts (4, or
    2 under EP 2); without grouped rows, as that many per-expert matmuls at the GEMM rate."""
    moe = model_preset("tiny-moe")
    flops = 3 * 2 * 1024 * 64 * 64
    plain = tmp_path / "plain.toml"
    plain.write_text(parse_profile(synthetic()).to_toml())
    data = synthetic()
    data["grouped_matmul"] = _grouped_rows({4: 1e9, 2: 4e9})
    grouped = tmp_path / "grouped.toml"
    grouped.write_text(parse_profile(data).to_toml())
    for ep, rate in ((1, 1e9), (2, 4e9)):
        plan = ParallelPlan(dp_shard=2, zero=1, ep=ep, micro_batch=4, precision="fp32")
        a = layer_work(moe, plan, profile_device(plain, 2), EFF, moe=True)
        b = layer_work(moe, plan, profile_device(grouped, 2), EFF, moe=True)
        for got, ref in ((b.forward_s, a.forward_s), (b.backward_input_s, a.backward_input_s)):
            assert got - ref == pytest.approx(flops / rate - flops / GEMM)
        assert b.backward_weight_s - a.backward_weight_s == pytest.approx(
            flops / rate - flops / GEMM
        )
    measured = rates_for(profile_device(grouped, 2))
    assert measured.grouped_time_s(4, 1024, 64, 64, "fp32", "tn") == pytest.approx(
        2 * 1024 * 64 * 64 / 1e9
    )
    assert measured.grouped_time_s(2, 1024, 64, 64, "fp32", "nn") == pytest.approx(
        2 * 1024 * 64 * 64 / 4e9
    )
    fallback = rates_for(profile_device(plain, 2))
    assert fallback.grouped_time_s(4, 1024, 64, 64, "fp32", "nt") == pytest.approx(
        2 * 1024 * 64 * 64 / GEMM
    )
    bad = synthetic()
    bad["grouped_matmul"] = _grouped_rows({4: 1e9})
    bad["grouped_matmul"][0]["layout"] = "xx"
    with pytest.raises(ConfigError, match=r"grouped_matmul\[0\]\.layout"):
        parse_profile(bad)


def test_context_parallel_attention_uses_the_block_rates_by_hand(tmp_path):
    """Ring and all-gather CP run the runtime's block kernels: the attention of a CP 2 layer is
    its FLOPs (64 local tokens of tiny's 128 attending 64 keys on average: 4 b h 64 64 d) at
    the cp = 2 rows' rates; Ulysses attends whole sequences on fewer heads (cp = 1 rows)."""
    data = synthetic()
    data["attention"] += [
        dict(dtype="fp32", threads=t, batch=4, heads=4, kv_heads=2, seq=64, head_dim=16, cp=2,
             forward_flops_per_s=5e8, backward_flops_per_s=4e8)
        for t in (1, 2)
    ]  # fmt: skip
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    device = profile_device(path, 2)
    flops = 4.0 * 4 * 4 * 64 * 64 * 16
    for kind, (fwd, bwd) in (("ring", (5e8, 4e8)), ("allgather", (5e8, 4e8))):
        plan = ParallelPlan(cp=2, cp_kind=kind, micro_batch=4, precision="fp32")
        work = layer_work(TINY, plan, device, EFF)
        assert work.attention_forward_s == pytest.approx(flops / fwd)
        assert work.attention_backward_s == pytest.approx(2 * flops / bwd)
    plan = ParallelPlan(cp=2, cp_kind="ulysses", micro_batch=4, precision="fp32")
    work = layer_work(TINY, plan, device, EFF)
    assert work.attention_forward_s == pytest.approx(flops / ATT_F)
    one = layer_work(TINY, ParallelPlan(micro_batch=4, precision="fp32"), device, EFF)
    assert one.attention_forward_s == pytest.approx(2 * flops / ATT_F)  # 128 x 64 keys


def test_expert_parallel_layers_carry_their_extra(tmp_path):
    """A MoE layer under EP 2 on two profiles that differ only in the EP extra: its forward and
    input-gradient backward differ by exactly that extra; without EP, not at all."""
    moe = model_preset("tiny-moe")
    free, paid = without_overheads(tmp_path, "ep")
    for ep, extra in ((2, (EP_F, EP_B)), (1, (0.0, 0.0))):
        plan = ParallelPlan(dp_shard=2, zero=1, ep=ep, micro_batch=4, precision="fp32")
        a = layer_work(moe, plan, profile_device(free, 2), EFF, moe=True)
        b = layer_work(moe, plan, profile_device(paid, 2), EFF, moe=True)
        assert b.forward_s - a.forward_s == pytest.approx(extra[0], abs=1e-15)
        assert b.backward_input_s - a.backward_input_s == pytest.approx(extra[1], abs=1e-15)


def test_bandwidth_measured_with_as_many_processes_streaming_as_the_run(tmp_path):
    """Rows measured alone and with 2 processes streaming at once: a 1-rank run reads the
    first, a 2-rank run the second, a 4-rank run (one-thread ranks on 2 cores: half the
    machine each) the nearest, 2, at half the rate; the optimizer step follows."""
    data = synthetic()
    data["bandwidth"] += [
        dict(kind=k, threads=t, processes=2, bytes_per_s=v / 2)
        for t in (1, 2)
        for k, v in BW.items()
    ]
    path = tmp_path / "p.toml"
    path.write_text(parse_profile(data).to_toml())
    one = rates_for(profile_device(path, 1))  # 1 or 2 threads: the same synthetic rates
    assert one.stream_bytes_per_s("optimizer") == pytest.approx(BW["optimizer"])
    two = rates_for(profile_device(path, 2))
    assert two.stream_bytes_per_s("elementwise_forward") == pytest.approx(
        BW["elementwise_forward"] / 2
    )
    four = rates_for(profile_device(path, 4))
    assert four.stream_bytes_per_s("loss_backward") == pytest.approx(BW["loss_backward"] / 2 * 0.5)
    plan = ParallelPlan(micro_batch=4, precision="fp32")
    assert optimizer_step_s(1e6, plan, profile_device(path, 2), EFF) == pytest.approx(
        1e6 * 36 / (BW["optimizer"] / 2)
    )


def test_published_band_does_not_apply_to_a_measured_device(profile_path):
    """The published GPU runs' residuals say nothing about fivefold's own runtime on a
    calibrated CPU: no band, ranking by the prediction, and the confidence line says where
    this device's errors are checked instead."""
    from fivefold.planner.budget import uncertainty as U
    from fivefold.planner.explain.result import confidence_line

    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(dp_shard=2, zero=3, micro_batch=4, precision="fp32")
    est = estimate(TINY, cluster, plan)
    assert U.band(est) is None
    assert U.band_json(est)["step_time_s"] is None
    assert U.rank_factor(TINY, cluster, plan, "pessimistic") == 1.0
    assert U.rank_tokens_per_s(est, "pessimistic") == est.tokens_per_s
    line = confidence_line(est, "pessimistic")
    assert "benchmarks/plan_vs_run.py" in line and "band" not in line


def test_runtime_units_one_collective_per_wrapped_module():
    """fivefold's runtime wraps every block and each chunk's root (and, under EP, each MoE
    block's experts apart): a rank holding chunks of 3 and 2 blocks issues 3 + 2 + 2 roots."""
    from fivefold.planner.step_time.rank_tail import runtime_units

    dense = ParallelPlan(pp=2, vpp=2, schedule="interleaved-1f1b", micro_batch=1, grad_accum=4)
    assert runtime_units(dense, [(3, 0, True, False), (2, 0, False, False)]) == (7, 0)
    moe = ParallelPlan(dp_shard=2, zero=1, ep=2)
    assert runtime_units(moe, [(0, 2, True, True)]) == (3, 2)
    assert runtime_units(ParallelPlan(dp_shard=2, zero=1), [(0, 2, True, True)]) == (3, 0)


def test_zero1_reduces_once_per_unit_on_a_measured_device(profile_path):
    """tiny-moe (2 MoE layers) at ZeRO-1 x EP2 on 2 ranks: the dense gradients leave in 3
    reduce-scatters (2 blocks and the root), each paying its own latency, not one per
    `layer's worth` of parameters (the embedding and head are 13 layers' worth)."""
    from fivefold.planner.options import PlannerOptions
    from fivefold.planner.step_time.rank_tail import tail_costs

    moe = model_preset("tiny-moe")
    cluster = profile_cluster(profile_path, 2)
    opts = PlannerOptions.for_device(cluster.device)
    plan = ParallelPlan(dp_shard=2, zero=1, ep=2, micro_batch=1, precision="fp32")
    dense = 574_272.0  # any parameter count: only the count of collectives matters here
    grad, *_ = tail_costs(moe, plan, cluster, EFF, opts, dense, 0.0, (3, 2))
    size = dense * 4
    copy = 2 * size / BW["elementwise_forward"]  # FSDP2's copy into the reduce-scatter input
    assert grad == pytest.approx(3 * (1e-4 + size / 3 / 1e9) + copy)


def test_fsdp_copies_priced_on_a_one_rank_group(profile_path):
    """fivefold's runtime wraps every block in FSDP2 whatever the data-parallel degree, and
    FSDP2 copies the gradients into and out of its reduction even on a one-rank group: TP2
    (ZeRO-0, DP1) pays that copy and no transfer; ZeRO-1 x EP2's experts (a one-rank expert
    data-parallel group) pay the gradient and the parameter copies; one process (no FSDP2)
    pays nothing."""
    from fivefold.planner.options import PlannerOptions
    from fivefold.planner.step_time.rank_tail import tail_costs

    cluster = profile_cluster(profile_path, 2)
    opts = PlannerOptions.for_device(cluster.device)
    copy = 2 * 4e6 / BW["elementwise_forward"]  # 1e6 fp32 values read and written
    tp = ParallelPlan(tp=2, micro_batch=1, precision="fp32")
    grad, grad_bytes, _, gather, *_ = tail_costs(TINY, tp, cluster, EFF, opts, 1e6, 0.0, (3, 0))
    assert (grad, grad_bytes, gather) == (pytest.approx(copy), 0.0, 0.0)
    moe = model_preset("tiny-moe")
    ep = ParallelPlan(dp_shard=2, zero=1, ep=2, micro_batch=1, precision="fp32")
    grad, _, _, gather, *_ = tail_costs(moe, ep, cluster, EFF, opts, 0.0, 1e6, (0, 2))
    assert (grad, gather) == (pytest.approx(copy), pytest.approx(copy))
    alone = ParallelPlan(micro_batch=1, precision="fp32")
    one = profile_cluster(profile_path, 1)
    one_opts = PlannerOptions.for_device(one.device)
    assert tail_costs(TINY, alone, one, EFF, one_opts, 1e6, 0.0)[:4] == (0.0, 0.0, 0.0, 0.0)


def test_fivefold_ring_exchanges_by_hand(profile_path):
    """fivefold's ring attention on CP 2 (`_RingAttention`): forward one K/V exchange; backward
    one K/V exchange and two fp32 dK/dV exchanges; on a CPU nothing hides behind attention."""
    from fivefold.planner.step_time.compute import Work
    from fivefold.planner.step_time.layer_costs import _ring_costs

    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(cp=2, micro_batch=1, precision="bf16-mixed")
    link = C.plan_link(cluster, plan, "cp", EFF)
    kv = 128 * 2 * 32 * 2.0  # tokens x (K, V) x kv width x bf16
    work = Work(attention_forward_s=1.0, attention_backward_s=2.0)
    fwd, bwd, time_s, sent = _ring_costs(plan, work, kv, 2, link)
    p2p = 1e-4 + kv / 1e9
    grads = 1e-4 + 2 * kv / 1e9
    assert fwd == pytest.approx(p2p)
    assert bwd == pytest.approx(p2p + 2 * grads)
    assert time_s == pytest.approx(fwd + bwd)
    assert sent == pytest.approx(2 * kv + 2 * 2 * kv)


def test_shared_cores_give_a_waiting_rank_core_to_the_others(profile_path):
    """4 ranks on 2 cores (share 0.5, one thread each): the step is at most every rank's
    compute at full speed over the cores, plus the busiest rank's in-stage collectives at the
    share, plus what follows the pipeline; nothing changes when every rank has a core."""
    from fivefold.planner.estimate import shared_cores_step_s

    plan = ParallelPlan(pp=2, dp_shard=2, zero=1, micro_batch=1, grad_accum=4)
    crowded = profile_device(profile_path, 4)
    assert crowded.rank_profile.share == 0.5
    by_hand = (0.6 + 0.4) * 2 * 0.5 * 1 / 2 + 0.1 * 0.5 + 0.05
    assert shared_cores_step_s(plan, crowded, [0.6, 0.4], 0.1, 0.05) == pytest.approx(by_hand)
    alone = profile_device(profile_path, 2)
    assert shared_cores_step_s(plan, alone, [0.6, 0.4], 0.1, 0.05) == math.inf


def test_collective_gap_is_half_a_layer_forward(profile_path):
    """The compute that prices a plan's collectives on a measured device: half of one layer's
    forward at its micro-batch; none on a GPU cluster."""
    from fivefold.planner.step_time.layer_costs import collective_gap_s
    from fivefold.specs.cluster import cluster_preset

    cluster = profile_cluster(profile_path, 2)
    plan = ParallelPlan(tp=2, micro_batch=2, precision="fp32")
    forward = layer_work(TINY, plan, cluster.device, EFF).forward_s
    assert collective_gap_s(TINY, plan, cluster, EFF) == pytest.approx(forward / 2)
    assert collective_gap_s(TINY, plan, cluster_preset("dgx-h100", 8), EFF) is None


def test_a_profile_without_bf16_names_the_precision_not_the_layouts(profile_path):
    """The search's default bf16-mixed cannot be priced on a profile that measured fp32 only:
    said so, with the precision that fixes it, not blamed on micro-batches or GPU count."""
    from fivefold.planner.search.layouts import search

    cluster = profile_cluster(profile_path, 2)
    with pytest.raises(ConfigError) as err:
        search(model_preset("tiny"), cluster, global_batch=16)
    text = str(err.value)
    assert "precision 'bf16-mixed' computes in bf16" in text
    assert "no bf16 matmul measurement (measured: fp32)" in text
    assert "--precision fp32" in text and "Add GPUs" not in text
    best = search(model_preset("tiny"), cluster, global_batch=16, precisions=["fp32"])
    assert best.best_plan.precision == "fp32" and best.best_plan.world_size == 2


def test_pipeline_sends_priced_after_a_chunk_s_forward(tmp_path):
    """On a measured CPU a stage sends its activations after its whole forward of a
    micro-batch, not after a layer's share: with send/recv's alpha measured as 1e-4 s back to
    back and 1e-4 + 1 s after a 1 s GEMM (so alpha = 1e-4 + gap between), PP2 on tiny prices
    each send at the stages' mean forward seconds: p2p = 1e-4 + mean F + 256 x 64 x 4 B / 1e9."""
    data = synthetic()
    data["collective"].append(
        dict(op="send_recv", ranks=2, world=2, gap_s=1.0, alpha_s=1.0001, beta_bytes_per_s=1e9)
    )
    path = tmp_path / "gaps.toml"
    path.write_text(parse_profile(data).to_toml())
    plan = ParallelPlan(pp=2, micro_batch=2, grad_accum=4, precision="fp32")
    est = estimate(TINY, profile_cluster(path, 2), plan, efficiency=EFF)
    forward = est.stage_costs.forward_s
    assert est.stage_costs.p2p_s == pytest.approx(
        1e-4 + sum(forward) / len(forward) + 2 * 128 * 64 * 4 / 1e9
    )
