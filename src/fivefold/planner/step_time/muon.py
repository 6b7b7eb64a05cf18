"""Muon in the planner (`PlannerOptions.optimizer = "muon"`, `train.optimizer`): what fivefold's
Muon (`fivefold.train.muon`) changes in a step against AdamW.

- Memory: the blocks' 2-D matrices keep one fp32 momentum buffer instead of Adam's m and v
  (4 bytes per parameter fewer, sharded as the optimizer state is); the rest keeps AdamW's.
- Compute: every rank orthogonalises the whole of each matrix of its pipeline stage, k
  Newton-Schulz iterations in bf16; for an [A, B] matrix with m = min(A, B), n = max(A, B) an
  iteration is three matmuls, X X^T (m x n x m), the quintic's G G (m x m x m) and P X
  (m x m x n): 2k (2 m^2 n + m^3) FLOPs, each matmul priced on the device's GEMM rates.
- Communication: each matrix's update is all-gathered in bf16 over the ranks that hold a
  piece of it: its ZeRO shard group (zero >= 1) and then its TP group, one collective per
  matrix and group, after the backward and before the step (nothing to hide behind).

Derivations: docs/planner.md, section 4d.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fivefold.planner.memory.model_states import (
    MUON_SAVED_BYTES,
    chunk_layers,
    stage_muon_params,
    zero_divisors,
)
from fivefold.planner.quantities import gib, seconds
from fivefold.planner.rates.efficiency import EfficiencyModel, efficiency_model
from fivefold.planner.step_time.comm import all_gather_bytes, all_gather_time_s, plan_link
from fivefold.planner.step_time.compute import gemm_time_s
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import chunks_of_rank, dense_shard_degree
from fivefold.specs.model import ModelSpec, attention_matrices
from fivefold.specs.plan import ParallelPlan

NS_STEPS = 5  # train.muon_ns_steps' default
GATHER_BYTES = 2.0  # the update is gathered in bf16, the iteration's dtype


def layer_matrices(model: ModelSpec, moe: bool) -> list[tuple[int, int]]:
    """[A, B] of the whole matrices Muon steps in one layer: the attention projections, the
    dense MLP (or the shared experts as one MLP) and, in an MoE layer, the router."""
    h = model.hidden
    out = list(attention_matrices(model))
    width = model.shared_experts * model.expert_ffn if moe else model.ffn
    if width:
        gated = moe or model.mlp == "swiglu"
        out += [(width, h)] * (2 if gated else 1) + [(h, width)]
    if moe:
        out.append((model.experts, h))
    return out


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of `steps` quintic iterations on an [rows, cols] matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return 2.0 * steps * (2.0 * m * m * n + m**3)


def newton_schulz_s(
    rows: int, cols: int, cluster: ClusterSpec, eff: EfficiencyModel, steps: int = NS_STEPS
) -> float:
    """Seconds of `steps` iterations on one whole [rows, cols] matrix, GEMM by GEMM in bf16."""
    m, n = min(rows, cols), max(rows, cols)
    device = cluster.device
    per_iteration = (
        gemm_time_s(m, m, n, device, eff)
        + gemm_time_s(m, m, m, device, eff)
        + gemm_time_s(m, n, m, device, eff)
    )
    return steps * per_iteration


@dataclass(frozen=True)
class MuonCost:
    """What Muon adds to one pipeline rank's step (every figure per rank and step)."""

    flops: float  # Newton-Schulz
    compute_s: float
    gather_bytes: float  # sent by this rank in the whole-matrix all-gathers
    gather_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.gather_s


def muon_cost(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    layers: tuple[int, int],
    gap: float | None = None,
) -> MuonCost:
    """Muon's extra work on a rank holding `layers` = (dense, MoE) layers of the model."""
    flops = compute = sent = gather = 0.0
    shard = dense_shard_degree(plan) if plan.zero >= 1 else 1
    shard_link = plan_link(cluster, plan, "dp_shard_cp", eff, gap) if shard > 1 else None
    tp_link = plan_link(cluster, plan, "tp", eff, gap) if plan.tp > 1 else None
    for count, moe in ((layers[0], False), (layers[1], True)):
        if not count:
            continue
        for rows, cols in layer_matrices(model, moe):
            flops += count * newton_schulz_flops(rows, cols)
            compute += count * newton_schulz_s(rows, cols, cluster, eff)
            whole = rows * cols * GATHER_BYTES
            for link, n, size in ((shard_link, shard, whole / plan.tp), (tp_link, plan.tp, whole)):
                if link is not None:
                    gather += count * all_gather_time_s(size, n, link)
                    sent += count * all_gather_bytes(size, n)
    return MuonCost(flops, compute, sent, gather)


def muon_summary(est: Any) -> dict[str, float]:
    """Muon's figures for an `Estimate` made with `optimizer = "muon"`, on its pipeline rank
    that spends longest on them: the moment bytes saved against AdamW, the Newton-Schulz FLOPs
    and seconds, the all-gather bytes sent and seconds (per GPU and step)."""
    model, plan = est.model, est.plan
    eff = efficiency_model()
    shard = zero_divisors(plan.zero, dense_shard_degree(plan))[2]
    worst: dict[str, float] = {}
    for rank in range(plan.pp):
        chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
        layers = [chunk_layers(model, est.layer_counts, c) for c in chunks]
        total = (sum(n for n, _ in layers), sum(n for _, n in layers))
        cost = muon_cost(model, plan, est.cluster, eff, total)
        saved = sum(stage_muon_params(model, plan.tp, *ls) for ls in layers)
        row = {
            "moment_bytes_saved": saved * MUON_SAVED_BYTES / shard,
            "newton_schulz_flops": cost.flops,
            "newton_schulz_s": cost.compute_s,
            "gather_bytes": cost.gather_bytes,
            "gather_s": cost.gather_s,
        }
        if not worst or cost.seconds > worst["newton_schulz_s"] + worst["gather_s"]:
            worst = row
    return worst


def muon_line(est: Any) -> str:
    """The explanation's Muon line ("" for AdamW)."""
    if est.options.optimizer != "muon":
        return ""
    s = muon_summary(est)
    return (
        "Optimizer: Muon on the blocks' matrices keeps one fp32 momentum buffer instead of "
        f"Adam's two ({gib(s['moment_bytes_saved'])} less per GPU); every rank orthogonalises "
        f"the whole matrices of its stage, {s['newton_schulz_flops'] / 1e12:,.1f} TFLOP of "
        f"Newton-Schulz ({NS_STEPS} bf16 iterations) in {seconds(s['newton_schulz_s'])}, after "
        f"all-gathering their updates ({gib(s['gather_bytes'])} sent, "
        f"{seconds(s['gather_s'])}), per step; AdamW steps the embeddings, head and norms."
    )
