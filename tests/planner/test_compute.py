"""Compute model: FLOPs of small models by hand, the GEMM roofline, pass structure."""

from __future__ import annotations

import pytest
from arithmetic import gemm_intensity

from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.compute import (
    ComputeOptions,
    classic_attention,
    flash_attention_forward_s,
    gemm_time_s,
    layer_elementwise_bytes,
    layer_work,
    memory_time_s,
    optimizer_step_s,
)
from fivefold.planner.step_time.layer_matmuls import layer_gemms
from fivefold.specs import ParallelPlan, gpu, model_preset
from fivefold.specs.flops import forward_flops_per_token, training_flops_per_token

EFF = EfficiencyModel(
    gemm_peak_fraction=(("ampere", 0.8), ("hopper", 0.7)),
    gemm_half_intensity=0.5,
    attention_peak_fraction=0.5,
    hbm_fraction=0.8,
    layer_overhead_s=10e-6,
)
H100 = gpu("h100-sxm")


def test_tiny_forward_flops_by_hand():
    m = model_preset("tiny")  # h 64, q 64, kv 32, SwiGLU 176, 2 layers, V 4096, s 128
    attn_proj = 64 * (64 + 2 * 32) + 64 * 64
    mlp = 3 * 64 * 176
    norms_free = 2 * (attn_proj + mlp)  # 2 FLOPs per multiply-add
    scores = 4 * 4 * 16 * (128 / 2)  # causal: s/2 keys per query
    per_token = 2 * (norms_free + scores) + 2 * 4096 * 64
    assert forward_flops_per_token(m) == pytest.approx(per_token)
    assert training_flops_per_token(m) == pytest.approx(3 * per_token)
    full = training_flops_per_token(m, recompute="full")
    assert full == pytest.approx(3 * per_token + per_token - 2 * 4096 * 64)


def test_layer_gemms_cover_the_layer_matmul_flops():
    m = model_preset("llama3-8b")
    for tp in (1, 2, 8):
        plan = ParallelPlan(tp=tp, micro_batch=2)
        flops = sum(2 * mm * n * k * c for mm, n, k, c in layer_gemms(m, plan, False))
        tokens = 2 * m.seq_len
        from fivefold.specs.flops import layer_matmul_flops_per_token

        assert flops * tp == pytest.approx(tokens * layer_matmul_flops_per_token(m, False))


def test_moe_gemms_count_active_experts_only():
    m = model_preset("mixtral-8x7b")
    plan = ParallelPlan(ep=2, dp_shard=2, zero=1)
    from fivefold.specs.flops import layer_matmul_flops_per_token

    flops = sum(2 * mm * n * k * c for mm, n, k, c in layer_gemms(m, plan, True))
    assert flops == pytest.approx(m.seq_len * layer_matmul_flops_per_token(m, True))


def test_gemm_roofline():
    big = gemm_time_s(8192, 8192, 8192, H100, EFF)
    flops = 2 * 8192**3
    intensity = gemm_intensity(8192, 8192, 8192)
    ridge = H100.peak("bf16") / H100.hbm_bw_bytes_per_s
    expected = flops / (H100.peak("bf16") * 0.7 * intensity / (intensity + 0.5 * ridge))
    assert big == pytest.approx(expected)
    # A thin GEMM can never beat streaming its operands through HBM.
    thin = gemm_time_s(16, 8192, 8192, H100, EFF)
    operands = 2 * (16 * 8192 + 8192 * 8192 + 16 * 8192)
    assert thin >= operands / H100.hbm_bw_bytes_per_s
    assert gemm_time_s(0, 10, 10, H100, EFF) == 0.0


def test_passes_and_recompute():
    m = model_preset("llama3-8b")
    base = ParallelPlan(micro_batch=1)
    w = layer_work(m, base, H100, EFF)
    assert w.backward_weight_s == pytest.approx(w.gemm_forward_s)  # weight gradients
    attn = flash_attention_forward_s(m, base, H100, EFF)
    assert w.attention_forward_s == pytest.approx(attn)
    assert w.attention_backward_s == pytest.approx(2.5 * attn)
    elem = memory_time_s(layer_elementwise_bytes(m, base, False, ComputeOptions()), H100, EFF)
    assert w.forward_s == pytest.approx(w.gemm_forward_s + attn + elem + 10e-6)
    assert w.backward_input_s == pytest.approx(w.gemm_forward_s + 2.5 * attn + 2 * elem + 20e-6)
    full = layer_work(m, base.with_(recompute="full"), H100, EFF)
    assert full.backward_input_s == pytest.approx(w.backward_input_s + w.forward_s)
    sel = layer_work(m, base.with_(recompute="selective"), H100, EFF)
    assert sel.backward_input_s == pytest.approx(w.backward_input_s + attn)


def test_flash_attention_flops_causal():
    m = model_preset("llama3-8b")
    plan = ParallelPlan(micro_batch=1, tp=2, cp=2)
    t = flash_attention_forward_s(m, plan, H100, EFF)
    tokens = m.seq_len / 2
    flops = 4 * tokens * (m.seq_len / 2) * 128 * 32 / 2
    assert t == pytest.approx(flops / (H100.peak("bf16") * 0.5))


def test_sequence_parallel_divides_norm_traffic():
    m = model_preset("tiny")
    opts = ComputeOptions()
    no_sp = layer_elementwise_bytes(m, ParallelPlan(tp=2, sp=False), False, opts)
    sp = layer_elementwise_bytes(m, ParallelPlan(tp=2, sp=True), False, opts)
    region = 128 * (2 * 2 * 2 * 64 + 2 * 3 * 2 * 64)  # norms + residual adds, bf16
    assert no_sp - sp == pytest.approx(region / 2)


def test_optimizer_step_is_memory_bound():
    plan = ParallelPlan(precision="bf16-mixed")
    t = optimizer_step_s(1e9, plan, H100, EFF)
    # Adam: state read and written, gradient read, parameter written; clipping: the gradient
    # read for the norm, then read and written to scale it.
    size = 2 * 12 + 2 + 2 + 3 * 2
    assert t == pytest.approx(1e9 * size / (H100.hbm_bw_bytes_per_s * 0.8))


def test_roofline_takes_the_larger_side():
    """Each memory-side kernel runs at max(FLOPs / vector rate, bytes / bandwidth)."""
    from dataclasses import replace

    from fivefold.planner.step_time.compute import roofline_s

    bw = H100.hbm_bw_bytes_per_s * 0.8
    assert roofline_s(1e9, 1e9, H100, EFF) == pytest.approx(1e9 / bw)  # ~0.5 FLOP/byte
    slow = replace(H100, peak_flops={**H100.peak_flops, "fp32": 1e9})  # 1 GFLOP/s vectors
    assert roofline_s(1e9, 1e9, slow, EFF) == pytest.approx(1.0)


def test_short_attention_is_memory_bound():
    """Flash attention over 16 tokens moves more bytes than its FLOPs can hide: its time is
    q, k, v in and the output out at the bandwidth, not the FLOPs at the attention rate."""
    from fivefold.planner.step_time.compute import attention_times_s

    m = model_preset("llama3-8b").with_(seq_len=16)
    plan = ParallelPlan(micro_batch=1)
    fwd, bwd = attention_times_s(m, plan, H100, EFF)
    q, kv = 4096, 1024
    bw = H100.hbm_bw_bytes_per_s * 0.8
    assert fwd == pytest.approx(16 * 2 * (2 * q + 2 * kv) / bw)
    assert bwd == pytest.approx(16 * 2 * (4 * q + 4 * kv) / bw)
    flops = 4 * 16 * 8 * 128 * 32
    assert fwd > flops / (H100.peak("bf16") * 0.5)


def test_embedding_backward_writes_the_table():
    from fivefold.planner.step_time.compute import embedding_work

    m = model_preset("tiny")  # h 64, V 4096, s 128
    plan = ParallelPlan(micro_batch=2, precision="fp32")
    w = embedding_work(m, plan, H100, EFF)
    bw = H100.hbm_bw_bytes_per_s * 0.8
    rows = 2 * 128 * 64
    assert w.forward_s == pytest.approx(2 * rows * 4 / bw)
    assert w.backward_input_s == pytest.approx((4096 * 64 * 4 + rows * 3 * 4) / bw)


def test_full_recompute_early_stop_skips_each_blocks_last_matmul():
    """torch's non-reentrant checkpoint does not re-run a block's last matmul (module doc of
    `early_stop_skipped_flops_per_token`); the FLOP counter check is in tests/test_calibrate.py."""
    from fivefold.specs.flops import early_stop_skipped_flops_per_token

    m = model_preset("tiny")  # dense SwiGLU: w2 is 64 x 176, 2 layers
    assert early_stop_skipped_flops_per_token(m) == 2 * (2 * 64 * 176)
    full = training_flops_per_token(m, recompute="full")
    early = training_flops_per_token(m, recompute="full", early_stop=True)
    assert full - early == pytest.approx(2 * 2 * 64 * 176)
    moe = model_preset("tiny-moe")  # the shared expert's w2 is the last matmul of a MoE block
    skipped = moe.dense_layers * 2 * moe.hidden * moe.ffn
    skipped += moe.moe_layers * 2 * moe.hidden * moe.shared_experts * moe.expert_ffn
    assert early_stop_skipped_flops_per_token(moe) == skipped
    assert early_stop_skipped_flops_per_token(moe.with_(shared_experts=0)) == (
        moe.dense_layers * 2 * moe.hidden * moe.ffn
    )
    assert training_flops_per_token(m, recompute="selective", early_stop=True) == (
        training_flops_per_token(m, recompute="selective")
    )


def test_classic_attention_on_its_roofline_by_hand():
    """GPT 1.7B of SC21 on an A100 (s 2048, 24 heads of 96, b 16, bf16): the score GEMMs are
    bound by streaming the s^2 scores at `stream_fraction` of HBM, the softmax and dropout
    passes stream 9 bytes per score forward and 11 backward (not twice the forward's)."""
    a100 = gpu("a100-80gb")
    model = model_preset("tiny").with_(
        hidden=2304, heads=24, kv_heads=24, head_dim=96, ffn=9216, seq_len=2048, mlp="gelu"
    )
    plan = ParallelPlan(micro_batch=16, precision="bf16-mixed")
    eff = EFF.with_(stream_fraction=0.8)
    s, d, batch = 2048, 96, 16 * 24
    bw = 2.039e12 * 0.8
    flops_rate = a100.peak("bf16") * 0.8
    one_gemm = max(2 * s * s * d / flops_rate, 2 * (2 * s * d + s * s) / bw)
    assert one_gemm == pytest.approx(2 * (2 * s * d + s * s) / bw)  # memory-bound
    scores = batch * s * s
    with_dropout = classic_attention(model, plan, a100, eff, ComputeOptions(dropout=True))
    assert with_dropout[0] == pytest.approx(batch * 2 * one_gemm + scores * 9 / bw)
    assert with_dropout[1] == pytest.approx(batch * 4 * one_gemm + scores * 11 / bw)
    plain = classic_attention(model, plan, a100, eff, ComputeOptions(dropout=False))
    assert plain[0] == pytest.approx(batch * 2 * one_gemm + scores * 4 / bw)
    assert plain[1] == pytest.approx(batch * 4 * one_gemm + scores * 6 / bw)
    # context parallelism: a rank's s/2 queries meet all s keys (not (s/2)^2 scores)
    cp2 = classic_attention(model, plan.with_(cp=2), a100, eff, ComputeOptions(dropout=False))
    q = s / 2
    half_gemm = max(2 * q * s * d / flops_rate, 2 * (q * d + s * d + q * s) / bw)
    assert cp2[0] == pytest.approx(batch * 2 * half_gemm + batch * q * s * 4 / bw)
