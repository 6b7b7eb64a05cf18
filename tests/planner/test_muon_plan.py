"""The planner prices `train.optimizer = "muon"` (`planner.step_time.muon`): one fp32 moment for
the blocks' matrices instead of two, Newton-Schulz on whole matrices and their all-gathers.

Llama 3 8B on 64 H100s, TP2 x ZeRO-3 over 32: every figure below is derived by hand from the
model's shapes (h 4096, kv width 1024, ffn 14336, 32 layers) and compared with `estimate`.
"""

from __future__ import annotations

import json

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import efficiency_model
from fivefold.planner.search.candidates import lever_sets
from fivefold.planner.step_time.comm import all_gather_bytes
from fivefold.planner.step_time.muon import muon_summary, newton_schulz_s
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.units import GiB

MODEL = model_preset("llama3-8b")
CLUSTER = cluster_preset("dgx-h100", 64)
PLAN = ParallelPlan(tp=2, dp_shard=32, zero=3, micro_batch=1, grad_accum=8, precision="bf16-mixed")
H, KV, F, L = 4096, 1024, 14336, 32
# one layer's matrices: wq, wo [h, h]; wk, wv [kv, h]; w1, w3 [f, h], w2 [h, f]
MATRICES = [(H, H)] * 2 + [(KV, H)] * 2 + [(F, H)] * 3
MUON_PARAMS = L * sum(a * b for a, b in MATRICES)  # 6.98e9 of 8.03e9


def _pair():
    # both under the same options (the fused-kernel model's): only the optimizer differs
    adamw = estimate(MODEL, CLUSTER, PLAN, PlannerOptions())
    muon = estimate(MODEL, CLUSTER, PLAN, PlannerOptions(optimizer="muon"))
    return adamw, muon


def _ns_flops(a: int, b: int, k: int = 5) -> float:
    m, n = min(a, b), max(a, b)
    return k * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)  # X X^T, G G, P X


def test_one_moment_fewer_for_the_blocks_matrices():
    adamw, muon = _pair()
    saved = MUON_PARAMS / (2 * 32) * 4  # tp 2, optimizer state sharded over 32, 4 bytes
    a, m = adamw.worst_memory, muon.worst_memory
    assert a.optimizer - m.optimizer == pytest.approx(saved, rel=1e-12)
    assert (a.params, a.grads, a.activations) == (m.params, m.grads, m.activations)
    assert muon_summary(muon)["moment_bytes_saved"] == pytest.approx(saved, rel=1e-12)
    assert saved / GiB == pytest.approx(0.406, abs=1e-3)


def test_newton_schulz_and_gathers_join_the_step():
    adamw, muon = _pair()
    s = muon_summary(muon)
    flops = L * sum(_ns_flops(a, b) for a, b in MATRICES)
    assert s["newton_schulz_flops"] == pytest.approx(flops, rel=1e-12)  # 6.66e14
    eff = efficiency_model()
    seconds = L * sum(newton_schulz_s(a, b, CLUSTER, eff) for a, b in MATRICES)
    assert s["newton_schulz_s"] == pytest.approx(seconds, rel=1e-12)
    # bf16 updates gathered over the ZeRO group (32, the TP shard) then over TP (2)
    sent = L * sum(
        all_gather_bytes(a * b * 2 / 2, 32) + all_gather_bytes(a * b * 2, 2) for a, b in MATRICES
    )
    assert s["gather_bytes"] == pytest.approx(sent, rel=1e-12)
    extra = muon.breakdown_s["optimizer_s"] - adamw.breakdown_s["optimizer_s"]
    assert extra == pytest.approx(s["newton_schulz_s"] + s["gather_s"], rel=1e-9)
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(extra, rel=1e-6)


def test_a_pipeline_stage_orthogonalises_its_own_layers():
    plan = PLAN.with_(pp=2, dp_shard=16, schedule="1f1b")
    est = estimate(MODEL, CLUSTER, plan, PlannerOptions(optimizer="muon"))
    assert sum(est.layer_counts) == L and len(est.layer_counts) == 2
    flops = max(est.layer_counts) * sum(_ns_flops(a, b) for a, b in MATRICES)  # the larger
    assert muon_summary(est)["newton_schulz_flops"] == pytest.approx(flops, rel=1e-12)


def test_refused_levers_and_the_search():
    with pytest.raises(ConfigError, match=r"planner\.optimizer = 'muon'"):
        estimate(
            MODEL,
            CLUSTER,
            PLAN.with_(optimizer_states="8bit"),
            PlannerOptions(optimizer="muon"),
        )
    # every automatic memory lever is one Muon cannot honour: the search tries none
    assert lever_sets(MODEL, CLUSTER, {}, "adamw")
    assert lever_sets(MODEL, CLUSTER, {}, "muon") == ()


def test_cli_optimizer_flag(capsys):
    argv = [
        "plan", "estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64",
        "--tp", "2", "--zero", "3", "--mbs", "1", "--global-batch", "256",
    ]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert "muon" not in adamw
    assert main([*argv, "--optimizer", "muon", "--json"]) == 0
    muon = json.loads(capsys.readouterr().out)
    assert muon["planner"]["options"]["optimizer"] == "muon"
    assert muon["muon"]["newton_schulz_flops"] == pytest.approx(
        L * sum(_ns_flops(a, b) for a, b in MATRICES), rel=1e-12
    )
    assert muon["memory_gib"]["optimizer"] < adamw["memory_gib"]["optimizer"]
    assert main([*argv, "--optimizer", "muon"]) == 0
    assert "Optimizer: Muon on the blocks' matrices" in capsys.readouterr().out
    assert main([*argv, "--optimizer", "muon", "--optimizer-states", "8bit"]) == 2
    err = capsys.readouterr().err
    assert "plan.optimizer_states = '8bit' with planner.optimizer = 'muon'" in err
