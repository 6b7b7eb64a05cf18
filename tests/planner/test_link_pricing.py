"""Point-to-point exchanges priced by the links they cross, by hand on a two-node cluster.

dgx-h100: NVLink 900 GB/s marketed (450 one way), InfiniBand 50 GB/s per GPU, alpha 1 us on
NVLink and 5 us across nodes; with the efficiency fractions below a GPU achieves NV = 360 GB/s
on NVLink and IB = 45 GB/s through its own NIC. A collective whose ring crosses nodes with k
members per node uses k NICs (min(NV, k IB)); a point-to-point exchange waits for its slowest
hop, one GPU's NIC.
"""

from __future__ import annotations

import pytest

from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import explain
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.search.layouts import search
from fivefold.planner.step_time.comm import (
    all_gather_time_s,
    link_model,
    p2p_time_s,
    pipeline_link,
    plan_link,
)
from fivefold.specs import ParallelPlan, cluster_preset, model_preset

EFF = EfficiencyModel(nvlink_fraction=0.8, ib_fraction=0.9)
TWO_NODES = cluster_preset("dgx-h100", 16)
NV, IB = 360e9, 45e9
A_NV, A_IB = 1e-6, 5e-6
OPTS = PlannerOptions()  # a framework's fused runtime: one K/V exchange per ring step
LONG_7B = model_preset("vizz-7b").with_(seq_len=32768)  # 32 layers, hidden 4096, 32 kv heads


def comm(est, kind: str):
    return next(c for c in est.comm if c.kind == kind)


def test_cp_ring_across_two_nodes_waits_for_one_nic():
    """CP 16 over two nodes of 8: ranks 7 -> 8 and 15 -> 0 cross the network, each through its
    own NIC, and every ring step waits for them. Per layer and micro-batch, 15 steps forward
    (a K/V block) and 15 backward (K/V out, their gradients back: two blocks)."""
    plan = ParallelPlan(cp=16, zero=1, dp_shard=1, micro_batch=1, grad_accum=2)
    link = plan_link(TWO_NODES, plan, "cp", EFF)
    assert (link.kind, link.per_node) == ("ib", 8)
    block = 2048 * 2 * 4096 * 2  # tokens per rank x (K, V) x kv width x bf16 = 32 MiB
    assert p2p_time_s(block, link) == pytest.approx(A_IB + block / IB)
    est = estimate(LONG_7B, TWO_NODES, plan, OPTS, efficiency=EFF)
    cp = comm(est, "cp")
    per_layer = 15 * (A_IB + block / IB) + 15 * (A_IB + 2 * block / IB)
    assert cp.time_s == pytest.approx(32 * 2 * per_layer, rel=1e-12)
    assert cp.bytes_per_step == 32 * 2 * 15 * 3 * block
    # The multi-NIC ring rate would make it 8 times faster: 0.32 s instead of 2.58 s.
    assert cp.time_s > 7.9 * cp.bytes_per_step / min(NV, 8 * IB)
    assert cp.link == "ib" and cp.link_model == "p2p, slowest hop ib 45 GB/s per GPU"


def test_cp_ring_inside_a_node_stays_on_nvlink():
    plan = ParallelPlan(tp=2, cp=4, dp_shard=2, zero=1, sp=True)  # cp ranks 2 apart: 8 GPUs
    link = plan_link(TWO_NODES, plan, "cp", EFF)
    assert link.kind == "nvlink"
    assert p2p_time_s(1e9, link) == pytest.approx(A_NV + 1e9 / NV)
    assert link_model(link, "p2p", 4) == "p2p, nvlink 360 GB/s per GPU"


@pytest.mark.parametrize(
    ("tp", "pp"),
    [(8, 2), (4, 4)],  # stages one node apart; stages 4 ranks apart, every other hop crossing
)
def test_pipeline_send_across_nodes_uses_the_senders_nic(tp, pp):
    """Each boundary sends the micro-batch's activation (tokens x hidden bf16, split by TP with
    sequence parallelism); with 4 stages on 2 nodes, 0 -> 1 stays on NVLink but 1 -> 2 crosses
    and the schedule waits for it. Per step: 2 m sends per rank (activation, its gradient)."""
    plan = ParallelPlan(tp=tp, sp=True, pp=pp, grad_accum=8, zero=0, micro_batch=1)
    link = pipeline_link(TWO_NODES, plan, EFF)
    assert link.kind == "ib"
    boundary = 32768 * 4096 * 2 / tp
    one = A_IB + boundary / IB
    assert p2p_time_s(boundary, link) == pytest.approx(one)
    est = estimate(LONG_7B, TWO_NODES, plan, OPTS, efficiency=EFF)
    pp_cost = comm(est, "pp")
    assert pp_cost.bytes_per_step == 2 * 8 * boundary
    assert pp_cost.time_s == pytest.approx(2 * 8 * one, rel=1e-12)
    assert pp_cost.link_model == "p2p, slowest hop ib 45 GB/s per GPU"


def test_ep_all_to_all_across_nodes_sends_the_off_node_part_through_each_nic():
    """EP 16 over two nodes: of a rank's S bytes 8/16 leave the node through its NIC while 7/16
    go over NVLink; the network part bounds it. Dispatch and combine forward and backward: 4."""
    moe = LONG_7B.with_(experts=16, top_k=2, expert_ffn=1408)
    plan = ParallelPlan(ep=16, dp_shard=16, zero=1, micro_batch=1, grad_accum=1)
    link = plan_link(TWO_NODES, plan, "ep", EFF)
    assert (link.kind, link.per_node) == ("ib", 8)
    size = 32768 * 2 * 4096 * 2  # tokens x top_k x hidden x bf16
    one = 15 * A_IB + max(7 / 16 * size / NV, 8 / 16 * size / IB)
    est = estimate(moe, TWO_NODES, plan, OPTS, efficiency=EFF)
    ep = comm(est, "ep")
    assert ep.time_s == pytest.approx(32 * 4 * one, rel=1e-12)
    assert ep.bytes_per_step == pytest.approx(32 * 4 * size * 15 / 16)
    assert (
        ep.link_model == "all-to-all, 8/16 off node over ib 45 GB/s per GPU, nvlink 360 GB/s inside"
    )


def test_collectives_keep_the_multi_nic_ring():
    """ZeRO's gathers over 16 ranks on two nodes: NCCL's rings use all 8 NICs of a node, so the
    bus bandwidth is min(NV, 8 IB) = 360 GB/s, not one NIC's 45."""
    plan = ParallelPlan(dp_shard=16, zero=3)
    link = plan_link(TWO_NODES, plan, "dp_shard_cp", EFF)
    assert link.bandwidth == pytest.approx(min(NV, 8 * IB))
    s = 1e9
    ring = 14 * A_NV + 1 * A_IB + 15 / 16 * s / min(NV, 8 * IB)
    assert all_gather_time_s(s, 16, link) == pytest.approx(ring)
    words = "collective, NCCL rings over ib on 8 NIC(s) per node, 360 GB/s per GPU"
    assert link_model(link, "collective", 16) == words
    est = estimate(LONG_7B, TWO_NODES, plan, OPTS, efficiency=EFF)
    assert comm(est, "zero-gather").link_model == words
    assert est.to_json()["comm"][0]["link_model"] == est.comm[0].link_model


def test_flagship_cp_exchange_is_priced_at_one_nic_and_said_so():
    """vizz-7b, 64 x H100, 128K tokens, 4M-token batch: the CP16 ring across two nodes moves
    45 K/V blocks of 8,192 x 4,096 bf16 per layer and micro-batch (15 forward steps of one,
    15 backward of two) over 32 layers and 8 micro-batches; at one NIC (45 GB/s) that is
    34.4 s, longer than the exchange the multi-NIC ring rate gave (4.3 s)."""
    model = model_preset("vizz-7b").with_(seq_len=131072)
    cluster = cluster_preset("dgx-h100", 64)
    plan = ParallelPlan(cp=16, dp_shard=4, zero=3, micro_batch=1, grad_accum=8)
    est = estimate(model, cluster, plan, OPTS, efficiency=EFF)
    block = 8192 * 2 * 4096 * 2
    cp = comm(est, "cp")
    assert cp.bytes_per_step == 32 * 8 * 45 * block
    assert cp.time_s == pytest.approx(32 * 8 * (30 * A_IB + 45 * block / IB), rel=1e-12)
    assert cp.time_s == pytest.approx(34.4, abs=0.05)
    result = search(model, cluster, global_batch_tokens=4 * 2**20)
    across = [c for c in result.best.comm if c.kind == "cp" and c.link == "ib"]
    assert across, "the chosen layout still rings CP across nodes; pick a scenario that does"
    assert across[0].link_model == "p2p, slowest hop ib 45 GB/s per GPU"
    assert f"The key/value exchange ({across[0].link_model})" in " ".join(explain(result))
