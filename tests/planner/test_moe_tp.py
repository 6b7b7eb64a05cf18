"""The planner's side of geometry's expert rule (MoE with TP: each TP rank routes its own 1/tp
of the tokens to whole experts, EP over dp_shard x cp x tp), against hand-derived numbers; and
Megatron's expert tensor parallelism (`plan.etp` = tp) priced as before."""

from __future__ import annotations

import pytest

from fivefold.planner.efficiency import efficiency_model
from fivefold.planner.layer_costs import layer_cost_key, layer_costs, tp_collectives
from fivefold.planner.layer_matmuls import expert_projections, layer_gemms
from fivefold.planner.model_states import layer_params_per_rank
from fivefold.planner.options import PlannerOptions
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
