"""The planner's FP8 costs under tensor (and sequence) parallelism: which TP collectives move
FP8 with torchao's float8 styles (`fivefold.specs.float8.fp8_tensor_parallel`, the runtime's
rule, checked against the runtime's styles in tests/parallel/test_fp8_tensor_parallel.py) and
the amax all-reduces of tensorwise scales, against hand-derived values."""

from __future__ import annotations

import pytest

from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import efficiency_model
from fivefold.planner.step_time.comm import all_gather_time_s, plan_link
from fivefold.planner.step_time.layer_costs import (
    collective_gap_s,
    fp8_scale_all_reduces,
    layer_cost_key,
    layer_costs,
)
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.float8 import Fp8TensorParallel, fp8_tensor_parallel

L70 = model_preset("llama3-70b")  # h 8192, 64 heads, 8 KV heads (K, V 1024 x 8192), ffn 28672
L8 = model_preset("llama3-8b")  # h 4096, K, V 1024 x 4096: tensorwise keeps them in bf16
H100x8 = cluster_preset("dgx-h100", 8)
TP8 = ParallelPlan(tp=8, sp=True, precision="bf16-mixed", fp8="tensorwise")


def test_which_gathers_move_fp8():
    # 70B: every linear converts (tensorwise skips only K <= 4096 with N <= 1024)
    assert fp8_tensor_parallel(L70, "tensorwise", False) == Fp8TensorParallel(
        gathered_inputs=(True, True), gathered_grads=(True, True), colwise=5, rowwise=2
    )
    # 8B: K and V stay in bf16, so the attention input is gathered in bf16 (wq casts its copy)
    assert fp8_tensor_parallel(L8, "tensorwise", False) == Fp8TensorParallel(
        gathered_inputs=(False, True),
        gathered_grads=(True, True),
        colwise=3,
        rowwise=2,
        local_casts=1,
    )
    assert fp8_tensor_parallel(L70, "rowwise", False) == Fp8TensorParallel()
    assert fp8_tensor_parallel(L70, "none", False) == Fp8TensorParallel()


@pytest.mark.parametrize(("model", "fp8_gathers"), [(L70, 4), (L8, 3)])
def test_tp_all_gathers_move_one_byte_per_element_in_fp8(model, fp8_gathers):
    """Per layer and micro-batch (8192 tokens) TP8+SP moves 4 all-gathers and 4 reduce-scatters
    of [T, h] in bf16; tensorwise FP8 halves the all-gathers cast before the gather (70B: the
    attention and MLP inputs forward, both rowwise outputs' gradients backward; 8B: not the
    attention input). The reduce-scatters stay in bf16."""
    eff, opts = efficiency_model(), PlannerOptions()
    bf16 = layer_costs(model, layer_cost_key(TP8.with_(fp8="none")), H100x8, eff, opts, False)
    fp8 = layer_costs(model, layer_cost_key(TP8), H100x8, eff, opts, False)
    t_h = 8192 * model.hidden
    assert bf16.tp_bytes == pytest.approx(8 * 7 / 8 * t_h * 2)
    assert bf16.tp_bytes - fp8.tp_bytes == pytest.approx(fp8_gathers * 7 / 8 * t_h)
    gap = collective_gap_s(model, layer_cost_key(TP8), H100x8, eff)
    link = plan_link(H100x8, TP8, "tp", eff, gap)
    saved = all_gather_time_s(2 * t_h, 8, link) - all_gather_time_s(t_h, 8, link)
    assert bf16.tp_time_s - fp8.tp_time_s == pytest.approx(fp8_gathers * saved)
    assert saved > 0
    # without SP the inputs are replicated (cast locally) and the all-reduces move bf16
    no_sp = layer_cost_key(TP8.with_(sp=False))
    same = layer_costs(model, no_sp, H100x8, eff, opts, False)
    assert (
        same.tp_bytes
        == layer_costs(model, no_sp.with_(fp8="none"), H100x8, eff, opts, False).tp_bytes
    )


def test_tensorwise_scales_all_reduce_their_amax_over_tp():
    # 70B, 7 converted linears (5 colwise, 2 rowwise). Forward: 7 weight casts, the 2 rowwise
    # inputs (feature-sharded), the 2 inputs cast before their SP gather; backward: the 7
    # weights again, the 5 colwise output gradients (feature-sharded), the 2 rowwise ones (SP).
    assert fp8_scale_all_reduces(L70, TP8) == (11, 14)
    assert fp8_scale_all_reduces(L70, TP8.with_(sp=False)) == (9, 12)
    # FSDP2's FP8 all-gather precomputes the weights' scales once per step
    assert fp8_scale_all_reduces(L70, TP8.with_(dp_shard=2, zero=1)) == (4, 7)
    assert fp8_scale_all_reduces(L70, TP8.with_(recompute="full")) == (11, 25)
    assert fp8_scale_all_reduces(L70, TP8.with_(tp=1)) == (0, 0)


def test_fp8_with_tp_is_planned_and_cheaper_in_tp_traffic():
    """Llama 3 70B on 64 H100s, TP8+SP x PP4 x DP2: refused before FP8 ran with TP; now planned,
    faster than bf16, with less TP traffic per step."""
    cluster = cluster_preset("dgx-h100", 64)
    plan = ParallelPlan(
        tp=8, sp=True, pp=4, dp_shard=2, zero=1, precision="bf16-mixed", grad_accum=8
    )
    bf16, fp8 = (estimate(L70, cluster, plan.with_(fp8=f)) for f in ("none", "tensorwise"))
    tp_bytes = {e.kind: e.bytes_per_step for e in bf16.comm}["tp"]
    fp8_tp_bytes = {e.kind: e.bytes_per_step for e in fp8.comm}["tp"]
    # the busiest rank (stage 0, 21 layers) x 8 micro-batches x 7/8 x T h x (4 gathers halved,
    # and bf16's 2 backward re-gathers of its kept input shards at 2 B, `sp_regathered_inputs`:
    # FP8 keeps its FP8-gathered inputs whole)
    assert fp8.layer_counts[0] == 21
    assert tp_bytes - fp8_tp_bytes == pytest.approx(21 * 8 * (4 + 2 * 2) * 7 / 8 * 8192 * 8192)
    assert fp8.step_time_s < bf16.step_time_s
