"""Communication model: placement of groups on links, alpha-beta collective times."""

from __future__ import annotations

import pytest

from fivefold.planner.calibration import EfficiencyModel
from fivefold.planner.comm import (
    all_gather_bytes,
    all_gather_time_s,
    all_reduce_bytes,
    all_reduce_time_s,
    all_to_all_time_s,
    axis_groups,
    group_link,
    pipeline_link,
    plan_link,
)
from fivefold.spec import ParallelPlan, cluster_preset

EFF = EfficiencyModel(nvlink_fraction=0.8, ib_fraction=0.9)
H100x64 = cluster_preset("dgx-h100", 64)  # 8 nodes of 8; NVLink 900 GB/s, IB 50 GB/s per GPU
NV = 900e9 / 2 * 0.8  # one direction, achieved
IB = 50e9 * 0.9


def test_ring_volumes():
    assert all_reduce_bytes(1000.0, 4) == 1500.0
    assert all_gather_bytes(1000.0, 4) == 750.0
    assert all_reduce_bytes(1000.0, 1) == 0.0


def test_group_placement_and_bandwidth():
    tp = group_link(H100x64, 8, 1, EFF)
    assert tp.kind == "nvlink" and tp.bandwidth == pytest.approx(NV)
    # DP over all 64 GPUs with TP = 1: 8 members per node share 8 NICs.
    dp = group_link(H100x64, 64, 1, EFF)
    assert dp.kind == "ib" and dp.per_node == 8
    assert dp.bandwidth == pytest.approx(min(NV, 8 * IB))
    # DP with TP = 8: one member per node, one NIC.
    dp8 = group_link(H100x64, 8, 8, EFF)
    assert dp8.kind == "ib" and dp8.per_node == 1 and dp8.bandwidth == pytest.approx(IB)
    # TP = 2, DP = 32: four members per node.
    assert group_link(H100x64, 32, 2, EFF).bandwidth == pytest.approx(4 * IB)


def test_plan_axes_follow_mesh_order():
    plan = ParallelPlan(tp=2, cp=2, dp_shard=4, pp=4, zero=1)
    groups = axis_groups(plan)
    assert groups["tp"] == (2, 1)
    assert groups["cp"] == (2, 2)
    assert groups["dp_shard_cp"] == (8, 2)
    assert groups["pp"] == (4, 16)
    assert plan_link(H100x64, plan, "cp", EFF).kind == "nvlink"  # tp * cp = 4 <= 8
    assert plan_link(H100x64, plan, "dp_shard_cp", EFF).kind == "ib"  # 8 ranks, stride 2
    assert pipeline_link(H100x64, plan, EFF).kind == "ib"  # stages 16 ranks apart


def test_collective_times_alpha_beta():
    link = group_link(H100x64, 8, 1, EFF)
    s = 1e9
    assert all_reduce_time_s(s, 8, link) == pytest.approx(14 * 1e-6 + 2 * 7 / 8 * s / NV)
    assert all_gather_time_s(s, 8, link) == pytest.approx(7 * 1e-6 + 7 / 8 * s / NV)
    assert all_reduce_time_s(s, 1, link) == 0.0
    a2a_nv = all_to_all_time_s(s, 8, link)
    assert a2a_nv == pytest.approx(7e-6 + 7 / 8 * s / NV)
    cross = group_link(H100x64, 16, 1, EFF)  # two nodes of 8
    a2a = all_to_all_time_s(s, 16, cross)
    assert a2a == pytest.approx(15 * 5e-6 + max(7 / 16 * s / NV, 8 / 16 * s / IB))


def test_single_node_cluster_never_uses_ib():
    small = cluster_preset("dgx-a100", 4)
    assert group_link(small, 4, 1, EFF).kind == "nvlink"
