"""Memory levers in the planner: 8-bit/FP8 Adam states, CPU offload, FP8 compute.

Every figure is derived by hand from the rules in `fivefold.planner.memory.levers` and
`planner.step_time.lever_costs` (torchao 0.18's block of 256, FSDP2's CPUOffloadPolicy, the DGX
H100 host) and compared with what `estimate` and `search` return. fivefold's runtime refuses
the levers until it runs them (`ParallelPlan.runtime_problems`); `runtime_levers` stands in for
that runtime where a test needs the search or the CLI to accept them.
"""

from __future__ import annotations

import json

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.memory.levers import (
    HOST_RESERVED_FRACTION,
    memory_plan,
    moment_bytes,
    state_recipe,
)
from fivefold.planner.memory.stage import stage_memory
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import efficiency_model
from fivefold.planner.search.bounds import Bounds
from fivefold.planner.search.layouts import search
from fivefold.planner.step_time.compute import gemm_time_s
from fivefold.planner.step_time.layer_costs import layer_cost_key, layer_costs
from fivefold.planner.step_time.lever_costs import (
    HOST_BW_FRACTION,
    PCIE_FRACTION,
    fp8_layer_delta,
)
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.flops import training_flops_per_token
from fivefold.specs.hardware import GPUS, host
from fivefold.units import GiB

LLAMA8 = model_preset("llama3-8b")
H100x8 = cluster_preset("dgx-h100", 8)
# llama3-8b, per layer: attention h(q + 2k) + qh = 4096 (4096 + 2048) + 4096^2, SwiGLU 3 h f.
ATTN = 4096 * (4096 + 2 * 1024) + 4096 * 4096  # 41,943,040
MLP = 3 * 4096 * 14336  # 176,160,768
LAYER = ATTN + MLP + 2 * 4096  # with the two norms
N8B = 32 * LAYER + 2 * 128256 * 4096 + 4096  # embedding, head, final norm: 8,030,261,248
DGX_H100_BW = 2 * 8 * 38.4e9  # two sockets x 8 DDR5-4800 channels
PCIE5 = 63.0e9


@pytest.fixture
def runtime_levers(monkeypatch):
    """fivefold's runtime as it will be once it runs the levers (the levers' runtime half)."""
    original = ParallelPlan.runtime_problems

    def accepting(self, m=None):
        return [p for p in original(self, m) if "memory lever" not in p]

    monkeypatch.setattr(ParallelPlan, "runtime_problems", accepting)


def _est(plan: ParallelPlan, model=LLAMA8, cluster=H100x8):
    """The fused-kernel memory model's terms (what the framework profiles plan: ZeRO-3's
    gathered layers, DP buckets), without fivefold's runtime rules."""
    return estimate(model, cluster, plan, PlannerOptions(), runtime=False)


# ---- catalog ----------------------------------------------------------------------------------
def test_catalog_host_and_pcie_with_sources():
    assert N8B == 8_030_261_248
    assert GPUS["h100-sxm"].pcie_bw_bytes_per_s == PCIE5  # 32 GT/s x 16 x 128/130 / 8
    assert GPUS["a100-80gb"].pcie_bw_bytes_per_s == 31.5e9
    assert GPUS["cpu"].pcie_bw_bytes_per_s == 0
    dgx = host("h100")
    assert dgx.ram_bytes == 2e12 and dgx.mem_bw_bytes_per_s == pytest.approx(614.4e9)
    assert "DGX H100 datasheet" in dgx.source
    assert host("a100-40gb").ram_bytes == 1e12 and host("b200").mem_bw_bytes_per_s == 716.8e9
    assert host("h800") is None  # no sourced host: offload there is refused, not guessed
    with pytest.raises(ConfigError, match="catalog does not have"):
        _est(
            ParallelPlan(dp_shard=8, zero=1, offload="optimizer"),
            cluster=cluster_preset("hgx-h800"),
        )


# ---- optimizer states ---------------------------------------------------------------------------
def test_8bit_and_fp8_states_bytes():
    # torchao: one byte per element + one fp32 scale per 256 elements, for m and for v.
    assert moment_bytes("8bit") == moment_bytes("fp8") == 1 + 4 / 256
    assert state_recipe(ParallelPlan(optimizer_states="8bit")).optimizer_bytes == 4 + 2.03125
    assert state_recipe(ParallelPlan(precision="fp32", optimizer_states="fp8")).optimizer_bytes == (
        2.03125
    )
    assert (
        state_recipe(
            ParallelPlan(precision="bf16-no-master", optimizer_states="8bit")
        ).optimizer_bytes
        == 2.03125
    )
    with pytest.raises(ConfigError, match="already describe a compressed optimizer"):
        _est(ParallelPlan(precision="fp8-mixed", optimizer_states="8bit"))
    base = ParallelPlan(dp_shard=8, zero=1)
    fp32, q8 = _est(base).worst_memory, _est(base.with_(optimizer_states="8bit")).worst_memory
    assert fp32.optimizer == pytest.approx(N8B * 12 / 8)
    assert q8.optimizer == pytest.approx(N8B * 6.03125 / 8)
    assert (q8.params, q8.grads, q8.activations) == (fp32.params, fp32.grads, fp32.activations)


# ---- offload: memory -----------------------------------------------------------------------------
def test_optimizer_offload_moves_the_optimizer_tenant_to_the_host():
    base = ParallelPlan(dp_shard=8, zero=1)
    on, off = _est(base), _est(base.with_(offload="optimizer"))
    assert off.worst_memory.optimizer == 0
    assert (off.worst_memory.params, off.worst_memory.grads) == (N8B * 2, N8B * 2)
    assert off.worst_memory.host_bytes == pytest.approx(N8B * 12 / 8)
    assert on.host_memory is None and on.worst_memory.host_bytes == 0
    host_mem = off.host_memory
    assert host_mem.per_node_bytes == pytest.approx(8 * N8B * 12 / 8)
    assert host_mem.usable_bytes == 2e12 * (1 - HOST_RESERVED_FRACTION) and host_mem.fits
    # A recipe without a master copy also keeps the parameters the host step updates.
    fp32 = _est(base.with_(precision="fp32", offload="optimizer")).worst_memory
    assert fp32.host_bytes == pytest.approx(N8B * (8 + 4) / 8)


def test_full_offload_keeps_only_the_gathered_layers_on_the_device():
    z3 = ParallelPlan(dp_shard=8, zero=3)
    on, off = _est(z3).worst_memory, _est(z3.with_(offload="all")).worst_memory
    assert (off.params, off.grads, off.optimizer) == (0, 0, 0)
    assert off.host_bytes == pytest.approx(N8B * 16 / 8)
    assert off.other_terms["zero3_gathered_layers"] == on.other_terms["zero3_gathered_layers"]
    # The two gathered layers' fp32 shards as copied in, one layer's bf16 gradient shard out.
    assert off.other_terms["offload_staging"] == pytest.approx(LAYER / 8 * (2 * 4 + 2))
    assert off.activations == on.activations


def test_offload_on_a_device_without_host_link_moves_nothing():
    plan = ParallelPlan(dp_shard=2, zero=3, offload="all", precision="fp32")
    assert memory_plan(plan, GPUS["cpu"]).offload == "none"
    assert memory_plan(plan, GPUS["h100-sxm"]) is plan
    small = model_preset("small")
    assert stage_memory(small, memory_plan(plan, GPUS["cpu"]), 0, 1) == stage_memory(
        small, plan.with_(offload="none"), 0, 1
    )


def test_host_memory_is_checked_against_the_node():
    model = model_preset("llama3-405b")
    est = _est(ParallelPlan(dp_shard=8, zero=3, offload="all", recompute="full"), model=model)
    n = est.worst_memory.host_bytes * 8 / 16  # parameters per node, 16 bytes each
    assert n == pytest.approx(405.9e9, rel=0.01)
    assert est.host_memory.per_node_bytes == pytest.approx(16 * n)  # 6.5 TB of 1.6 usable
    assert not est.host_memory.fits and not est.fits
    assert est.host_memory.overflow_bytes == pytest.approx(16 * n - 1.6e12)


# ---- offload: step time ------------------------------------------------------------------------
def test_optimizer_offload_step_time():
    base = ParallelPlan(dp_shard=8, zero=1)
    on, off = _est(base), _est(base.with_(offload="optimizer"))
    owned = N8B / 8  # parameters whose Adam state a rank owns
    # Host step: clipping reads the bf16 gradient for the norm, then reads and writes it (3 x 2)
    # and Adam moves 2 x 12 (state read and written) + 2 (gradient) + 2 (parameter) bytes per
    # parameter: 34, for all 8 GPUs of the node, at 70 % of the DGX H100's DDR5.
    host_step = owned * 34 * 8 / (DGX_H100_BW * HOST_BW_FRACTION)
    assert off.breakdown_s["optimizer_s"] == pytest.approx(host_step)
    # Gradients out hide behind the last backward; parameters in (bf16) are exposed.
    h2d = owned * 2 / (PCIE5 * PCIE_FRACTION)
    assert off.breakdown_s["offload_exposed_s"] == pytest.approx(h2d)
    assert off.step_time_s - on.step_time_s == pytest.approx(
        host_step - on.breakdown_s["optimizer_s"] + h2d
    )
    pcie = next(c for c in off.comm if c.kind == "offload")
    assert pcie.link == "pcie" and pcie.bytes_per_step == pytest.approx(owned * 4)


def test_full_offload_step_time():
    eff, opts = efficiency_model(), PlannerOptions()
    z3 = ParallelPlan(dp_shard=8, zero=3, grad_accum=2)
    off = z3.with_(offload="all")
    plain = layer_costs(LLAMA8, layer_cost_key(z3), H100x8, eff, opts, False)
    lever = layer_costs(LLAMA8, layer_cost_key(off), H100x8, eff, opts, False)
    shard = LAYER / 8
    # Each gather first copies the fp32 shard in, each reduce-scatter copies the bf16 one out.
    assert lever.gather_s - plain.gather_s == pytest.approx(shard * 4 / (PCIE5 * PCIE_FRACTION))
    assert lever.reduce_s - plain.reduce_s == pytest.approx(shard * 2 / (PCIE5 * PCIE_FRACTION))
    est = _est(off)
    owned = N8B / 8
    # The second micro-batch's gradients are copied without overlap and added on the host.
    accumulate = owned * 2 / (PCIE5 * PCIE_FRACTION)
    accumulate += 3 * owned * 2 * 8 / (DGX_H100_BW * HOST_BW_FRACTION)
    assert est.breakdown_s["offload_exposed_s"] == pytest.approx(accumulate)
    assert est.breakdown_s["optimizer_s"] == pytest.approx(
        owned * 34 * 8 / (DGX_H100_BW * HOST_BW_FRACTION)
    )


# ---- FP8 compute ---------------------------------------------------------------------------------
def test_fp8_layer_time_is_fp8_gemms_plus_casts():
    eff, dev = efficiency_model(), H100x8.device
    plan = ParallelPlan(fp8="rowwise")
    t = 8192  # one sequence
    # Rowwise converts Q, O and the MLP; K and V (1024 x 4096, N <= 2048) stay in bf16.
    gemms = [(t, 4096, 4096), (t, 4096, 4096), (t, 2 * 14336, 4096), (t, 4096, 14336)]
    gemm = sum(gemm_time_s(*g, dev, eff, "fp8") - gemm_time_s(*g, dev, eff) for g in gemms)
    weights = 4096 * 4096 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096
    inputs = t * (4096 + 4096 + 4096 + 14336)  # X of each linear (T x k)
    outputs = t * (4096 + 4096 + 28672 + 4096)  # G of each linear (T x n)
    bw = dev.hbm_bw_bytes_per_s * eff.hbm_fraction
    delta = fp8_layer_delta(LLAMA8, plan, dev, eff, False)
    assert delta.forward_s == pytest.approx(gemm + 5 * (inputs + weights) / bw)
    assert delta.backward_input_s == pytest.approx(gemm + 5 * (outputs + weights) / bw)
    assert delta.backward_weight_s == pytest.approx(gemm + 5 * (outputs + inputs) / bw)
    assert delta.forward_s < 0  # at 8K tokens FP8 pays for its casts
    full = fp8_layer_delta(LLAMA8, plan.with_(recompute="full"), dev, eff, False)
    assert full.backward_input_s == pytest.approx(delta.backward_input_s + delta.forward_s)
    opts = PlannerOptions()
    bf16 = layer_costs(LLAMA8, layer_cost_key(ParallelPlan()), H100x8, eff, opts, False).work
    fp8 = layer_costs(LLAMA8, layer_cost_key(plan), H100x8, eff, opts, False).work
    assert fp8.forward_s == pytest.approx(bf16.forward_s + delta.forward_s)
    # Under ZeRO-3 with tensorwise scaling, the weights are cast as shards before an FP8 gather.
    z3 = fp8_layer_delta(
        LLAMA8, ParallelPlan(dp_shard=8, zero=3, fp8="tensorwise"), dev, eff, False
    )
    assert delta.forward_s - z3.forward_s == pytest.approx(5 * weights * (1 - 1 / 8) / bw)


def test_fp8_mfu_counts_fp8_flops_against_the_fp8_peak():
    plan = ParallelPlan(dp_shard=8, zero=1, fp8="rowwise")
    est = _est(plan)
    tokens = plan.global_batch * 8192
    fp8 = 6 * 32 * (2 * 4096**2 + MLP)  # per token, in the converted linears (no K, V)
    total = training_flops_per_token(LLAMA8, 8192)
    seconds_at_peak = fp8 / 1978.9e12 + (total - fp8) / 989.4e12
    assert est.mfu == pytest.approx(tokens * seconds_at_peak / (est.step_time_s * 8))
    bf16 = _est(plan.with_(fp8="none"))
    assert est.step_time_s < bf16.step_time_s
    with pytest.raises(ConfigError, match=r"plan.fp8 = 'rowwise' on a100-80gb: it has no FP8"):
        _est(plan, cluster=cluster_preset("dgx-a100", 8))


def test_fp8_all_gather_halves_the_gathered_weights():
    z3 = ParallelPlan(dp_shard=8, zero=3)
    bf16 = _est(z3).worst_memory.other_terms["zero3_gathered_layers"]
    tensorwise = _est(z3.with_(fp8="tensorwise")).worst_memory.other_terms
    rowwise = _est(z3.with_(fp8="rowwise")).worst_memory.other_terms
    # Two gathered layers: their converted matrices (Q, O, the MLP; tensorwise keeps K and V,
    # 1024 x 4096, in bf16) at 1 byte instead of 2; the norms stay in bf16.
    converted = 2 * 4096**2 + MLP
    assert bf16 - tensorwise["zero3_gathered_layers"] == pytest.approx(2 * converted)
    assert rowwise["zero3_gathered_layers"] == bf16  # rowwise gathers in bf16


@pytest.mark.parametrize("zero", [1, 2])
def test_fp8_all_gather_under_zero_1_and_2(zero):
    """The runtime gathers tensorwise FP8 weights in FP8 whenever FSDP2 shards them (ZeRO >= 1,
    `fivefold.parallel.float8.float8_config`): the gathered copy ZeRO-1/2 hold for the step and
    its once-per-step all-gather are 1 byte per converted weight."""
    plan = ParallelPlan(dp_shard=8, zero=zero)
    bf16, fp8 = _est(plan), _est(plan.with_(fp8="tensorwise"))
    converted = 32 * (2 * 4096**2 + MLP)  # every layer's Q, O and MLP matrices
    assert bf16.worst_memory.params - fp8.worst_memory.params == pytest.approx(converted)
    rowwise = _est(plan.with_(fp8="rowwise"))
    assert rowwise.worst_memory.params == bf16.worst_memory.params
    sent = [
        next(c.bytes_per_step for c in est.comm if c.kind == "zero-gather") for est in (bf16, fp8)
    ]
    assert sent[0] - sent[1] == pytest.approx(converted * 7 / 8)  # ring all-gather over 8


# ---- the search ---------------------------------------------------------------------------------
def test_search_uses_levers_only_when_nothing_fits(runtime_levers):
    model = model_preset("llama3-70b")
    result = search(model, H100x8, global_batch_tokens=2**20)
    plan = result.best_plan
    assert plan.offload != "none"  # 8-bit states alone leave it 18.6 GiB short
    assert plan.fp8 == "none"  # FP8 compute only when asked for
    miss = result.without_levers
    assert miss is not None and miss.reason.startswith("out of memory")
    assert miss.plan.offload == "none" and miss.plan.optimizer_states == "fp32"
    assert result.best.fits_with(0.10) and result.best.host_fits
    line = next(x for x in explain(result) if x.startswith("Memory levers"))
    assert "nothing fits in 80 GiB of HBM (72.0 GiB usable) without them" in line
    assert "Chose" in line and "host" in line
    # No layout without levers fits: the first pass found nothing.
    assert all(
        o.plan.offload != "none" or o.plan.optimizer_states != "fp32"
        for o in result.outcomes.values()
        if o.fits
    )


def test_search_prefers_8bit_states_when_they_suffice(runtime_levers):
    # 70B on 16 GPUs misses without levers; 8-bit states fit and cost no PCIe or host step.
    # Ranked by the prediction itself: the pessimistic ranking prefers a layout nearer the
    # published runs (TP4 DP2 CP2) that also needs the optimizer offloaded.
    model = model_preset("llama3-70b")
    # The fused-kernel memory model (other software): fivefold's eager runtime keeps more
    # activations, and 8-bit states alone do not make a 16-GPU layout fit there.
    result = search(
        model,
        cluster_preset("dgx-h100", 16),
        global_batch_tokens=2**20,
        risk="expected",
        options=PlannerOptions(),
    )
    assert result.without_levers is not None
    assert result.best_plan.optimizer_states == "8bit" and result.best_plan.offload == "none"
    assert result.best.host_memory is None
    line = next(x for x in explain(result) if x.startswith("Memory levers"))
    assert "Chose 8bit Adam states: " in line and "6.03 optimizer bytes per parameter" in line
    assert "offload of the optimizer: " in line  # the best layout with each other lever


def test_search_without_levers_when_the_model_fits(runtime_levers):
    result = search(model_preset("llama3-8b"), H100x8, global_batch_tokens=2**20)
    assert result.without_levers is None
    assert all(
        (o.plan.offload, o.plan.optimizer_states, o.plan.fp8) == ("none", "fp32", "none")
        for o in result.outcomes.values()
    )
    line = next(x for x in explain(result) if x.startswith("Memory levers"))
    assert line.startswith("Memory levers: none; the layout fits in 80 GiB")


def test_search_proposes_no_lever_the_runtime_refuses(monkeypatch):
    # A runtime that refuses CPU offload (as fivefold's did before it ran it): the second pass
    # tries 8-bit states only, which leave 70B on 8 GPUs 18.6 GiB short.
    original = ParallelPlan.runtime_problems

    def no_offload(self, m=None):
        kept = [p for p in original(self, m) if "memory lever" not in p]
        return kept + (["plan.offload: not run here"] if self.offload != "none" else [])

    monkeypatch.setattr(ParallelPlan, "runtime_problems", no_offload)
    with pytest.raises(ConfigError, match="no layout of llama3-70b fits") as err:
        search(model_preset("llama3-70b"), H100x8, global_batch_tokens=2**20)
    assert "memory levers did not make any layout fit either (optimizer_states 8bit)" in str(
        err.value
    )


def test_search_keeps_pinned_fp8(runtime_levers):
    result = search(
        model_preset("llama3-8b"), H100x8, global_batch_tokens=2**20, fixed={"fp8": "rowwise"}
    )
    assert result.best_plan.fp8 == "rowwise"
    assert all(est.plan.fp8 == "rowwise" for est in result.alternatives)
    line = next(x for x in explain(result) if x.startswith("Memory levers"))
    assert "FP8 compute (rowwise" in line and "effective peak" in line


def test_bounds_stay_below_the_estimate_with_levers():
    bounds = Bounds(LLAMA8, H100x8)
    for plan in (
        ParallelPlan(dp_shard=8, zero=3, offload="all"),
        ParallelPlan(dp_shard=8, zero=1, offload="optimizer", optimizer_states="8bit"),
        ParallelPlan(dp_shard=8, zero=3, fp8="tensorwise"),
    ):
        est = _est(plan)
        assert bounds.memory(plan, [1]) <= est.peak_memory_bytes + 1
        assert bounds.step(plan) <= est.step_time_s


# ---- CLI ---------------------------------------------------------------------------------------
def test_plan_estimate_takes_the_lever_flags(runtime_levers, capsys):
    argv = ["plan", "estimate", "--model", "llama3-8b", "--gpus", "8", "--zero", "3"]
    argv += ["--offload", "all", "--optimizer-states", "8bit", "--global-batch", "16"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["offload"] == "all" and data["plan"]["optimizer_states"] == "8bit"
    assert data["memory_gib"]["params"] == 0
    assert data["host_memory"]["per_gpu_gib"] == pytest.approx(N8B * 10.03125 / 8 / GiB)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "(bf16-mixed, 8bit Adam states, offload all)" in text
    assert "host memory (offloaded)" in text and "DGX H100" in text
    fp8 = ["plan", "estimate", "plan.fp8=rowwise", "--model", "llama3-8b", "--gpus", "8"]
    assert main([*fp8, "--global-batch", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["fp8"] == "rowwise"


def test_custom_cluster_uses_the_gpu_host():
    cluster = ClusterSpec(name="custom", gpu="a100-80gb", intra_node_bw=600e9, inter_node_bw=25e9)
    est = _est(ParallelPlan(dp_shard=8, zero=1, offload="optimizer"), cluster=cluster)
    assert est.host_memory.system == "DGX A100 640GB"
    assert est.host_memory.node_ram_bytes == 2e12
