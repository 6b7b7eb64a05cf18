"""The planner's side of geometry's expert rule (MoE with TP: each TP rank routes its own 1/tp
of the tokens to whole experts, EP over dp_shard x cp x tp), against hand-derived numbers; and
Megatron's expert tensor parallelism (`plan.etp` = tp) priced as before."""

from __future__ import annotations

import pytest

from fivefold.planner.memory.model_states import layer_params_per_rank
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import efficiency_model
from fivefold.planner.step_time.layer_costs import layer_cost_key, layer_costs, tp_collectives
from fivefold.planner.step_time.layer_matmuls import expert_projections, layer_gemms
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.geometry import axis_groups, expert_shard_degree

MIXTRAL = model_preset("mixtral-8x7b").with_(seq_len=4096)  # 8 experts, top-2, no shared
H, F = 4096, 14336  # Mixtral's hidden and expert widths
EXPERT = 3 * H * F  # one SwiGLU expert's parameters
TP2_EP8 = ParallelPlan(tp=2, dp_shard=32, zero=3, ep=8)


def test_routed_experts_are_whole_and_sharded_over_dp_shard_cp_tp():
    lp = layer_params_per_rank(MIXTRAL, True, 2, 8)
    assert lp.experts == 8 / 8 * EXPERT  # one whole expert per rank, not half of one
    assert layer_params_per_rank(MIXTRAL, True, 2, 8, etp=2).experts == EXPERT / 2
    assert expert_shard_degree(TP2_EP8) == 32 * 2 // 8  # ZeRO over dp_shard x tp / ep
    groups = axis_groups(TP2_EP8)
    assert groups["ep"] == (8, 1)  # the TP pair and 4 dp_shard neighbours: one node
    assert groups["expert_shard"] == (8, 8)


def test_each_tp_rank_routes_and_dispatches_its_own_tokens():
    plan = TP2_EP8.with_(micro_batch=1)
    tokens = 4096 / 2  # the rank's half of one sequence
    router = layer_gemms(MIXTRAL, plan, True)[-3]
    assert router == (tokens, 8, H, 1.0)
    rows = tokens * 2  # top-2 copies, balanced over the 8 experts of the EP group
    assert expert_projections(MIXTRAL, plan) == [(1, rows, F, H), (1, rows, F, H), (1, rows, H, F)]
    cluster = cluster_preset("dgx-h100", 64)
    costs = layer_costs(
        MIXTRAL, layer_cost_key(plan), cluster, efficiency_model(), PlannerOptions(), True
    )
    size = tokens * 2 * H * 2  # the k copies of the own tokens, bf16
    assert costs.ep_bytes == pytest.approx(4 * size * 7 / 8)  # dispatch + combine, fwd + bwd
    megatron = layer_costs(
        MIXTRAL,
        layer_cost_key(plan.with_(etp=2)),
        cluster,
        efficiency_model(),
        PlannerOptions(),
        True,
    )
    assert megatron.ep_bytes == pytest.approx(2 * costs.ep_bytes)  # every TP rank, all tokens


def test_tp_collectives_of_a_moe_layer():
    deepseek = model_preset("deepseek-v3")  # one shared expert
    sp, no_sp = ParallelPlan(tp=2), ParallelPlan(tp=2, sp=False)
    assert tp_collectives(MIXTRAL, sp, False) == (2, 0)  # dense: attention and MLP pairs
    assert tp_collectives(MIXTRAL, sp, True) == (1, 0)  # attention only: tokens already split
    assert tp_collectives(MIXTRAL, no_sp, True) == (1, 1)  # + the output's all-gather
    assert tp_collectives(deepseek, sp, True) == (2, 0)  # + the shared experts' pair
    assert tp_collectives(MIXTRAL, sp.with_(etp=2), True) == (2, 0)  # expert TP: as dense


def test_the_experts_gradient_reduction_holds_reduce_dtype_copies():
    """FSDP2 reduces a block's routed experts as a unit of their own: an fp32 input of all
    their gradients beside the bf16 ones (6 B per parameter), then beside its output, 1/n of
    them over the expert ZeRO group of n; on one rank also `input / divide_factor` (12 B)."""
    from fivefold.planner.memory.eager import _experts_reduce_bytes
    from fivefold.specs.precision import recipe

    bf16 = recipe("bf16-mixed")
    one_rank = ParallelPlan(tp=2, dp_shard=4, zero=3, ep=8)  # one whole expert, group of 1
    assert expert_shard_degree(one_rank) == 1
    assert _experts_reduce_bytes(one_rank, EXPERT, bf16) == 12 * EXPERT
    two_ranks = one_rank.with_(ep=4)  # two experts, sharded over 2
    assert _experts_reduce_bytes(two_ranks, 2 * EXPERT, bf16) == (2 + 4) * 2 * EXPERT
    eight = TP2_EP8  # over 8: the copy-in (bf16 + fp32) is the larger
    assert _experts_reduce_bytes(eight, EXPERT, bf16) == 6 * EXPERT


def test_the_last_blocks_expert_reduction_is_in_the_peak_without_recompute():
    """DeepSeek-V3's widths, TP8 x EP8 on 8 ranks, no recompute: the last block's 32 experts
    are reduced first in the backward, three fp32 copies of their gradients at once, which the
    activation peak holds (1.2 GiB of activations were planned before; `plan check` counts 46.7
    GiB in all, tests/test_plan_check.py)."""
    from fivefold.planner.memory.options import MemoryOptions
    from fivefold.planner.memory.stage import all_stage_memory

    eager = MemoryOptions(runtime="fivefold-eager", fsdp_wrapped=True)
    deepseek = model_preset("deepseek-v3").with_(seq_len=4096, layers=4, dense_layers=3)
    plan = ParallelPlan(tp=8, zero=3, ep=8, micro_batch=1, grad_accum=2, recompute="none")
    experts = 256 / 8 * 3 * 7168 * 2048  # whole experts per rank: 256/8 of 3 h f_e each
    assert layer_params_per_rank(deepseek, True, 8, 8).experts == experts
    (stage,) = all_stage_memory(deepseek, plan, [1], eager)
    # the rest (saved tensors, less the logits' buffers then freed) is within 1 GiB of 0, once
    # the 7 gathered inputs kept as their 1/8 shard are counted (3 dense layers' attention and
    # MLP, the MoE layer's attention: `sp_regathered_inputs`, 2 B x 4096 x 7168 x 7/8 each)
    regathered = 7 * 2 * 4096 * 7168 * 7 / 8
    assert stage.activations == pytest.approx(12 * experts - regathered, abs=2**30)
    (without,) = all_stage_memory(deepseek, plan.with_(zero=1), [1], eager)  # no reduce-scatter
    assert without.activations < 2 * 2**30


def test_the_router_gradient_all_reduce_over_tp_is_priced_and_explained():
    """Each TP rank's router gradient covers its own tokens: one all-reduce of the [E, h]
    bf16 gradient over TP per MoE layer backward, beside attention's SP pair (an all-gather
    and a reduce-scatter of the [T, h] bf16 stream forward and again backward)."""
    from fivefold.planner.explain.result import explain
    from fivefold.planner.search.layouts import search

    plan = TP2_EP8.with_(micro_batch=1)
    cluster = cluster_preset("dgx-h100", 64)
    key = layer_cost_key(plan)
    costs = layer_costs(MIXTRAL, key, cluster, efficiency_model(), PlannerOptions(), True)
    stream = 4096 * H * 2  # one micro-batch's [T, h] in bf16, gathered size
    pair = 2 * stream * (2 - 1) / 2  # all-gather + reduce-scatter, (t - 1)/t each
    router = 2 * (2 - 1) / 2 * (8 * H * 2)  # ring all-reduce of [E, h] bf16
    assert costs.tp_bytes == pytest.approx(2 * pair + router)
    dense = layer_costs(MIXTRAL, key, cluster, efficiency_model(), PlannerOptions(), False)
    assert dense.tp_bytes == pytest.approx(4 * pair)  # attention and MLP pairs, no router
    etp = layer_costs(
        MIXTRAL,
        layer_cost_key(plan.with_(etp=2)),
        cluster,
        efficiency_model(),
        PlannerOptions(),
        True,
    )
    assert etp.tp_bytes == pytest.approx(4 * pair)  # expert TP: router on all tokens, replicated
    fixed = {"tp": 2, "sp": True, "ep": 8, "etp": 1, "dp_shard": 32, "pp": 1, "cp": 1}
    result = search(MIXTRAL, cluster, global_batch_tokens=2**22, fixed=fixed)
    line = next(x for x in explain(result) if x.startswith("Expert parallelism"))
    assert "attention's all-gather / reduce-scatter pairs" in line
    assert "all-reduces its 8 x 4096 gradient over the 2 TP ranks" in line
