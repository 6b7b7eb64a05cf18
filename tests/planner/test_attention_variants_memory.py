"""The memory model's tenants of Qwen's attention variants, by hand: Q/K/V biases split over TP
with their weights (one replicated kv head when tp exceeds the kv heads), QK-norm weights
replicated, and the activations the QK-norms keep in the fused-kernel (Korthikanti) model.
fivefold's eager runtime is checked against autograd in tests/test_saved_activations.py."""

from __future__ import annotations

import dataclasses

from fivefold.planner.memory.activations import layer_activation_bytes
from fivefold.planner.memory.model_states import layer_params_per_rank
from fivefold.specs import ModelSpec, ParallelPlan

# Qwen2-7B's attention widths: h 3584, 28 query heads and 4 kv heads of 128, ffn 18944.
QWEN2 = ModelSpec("q", 2, 3584, 28, kv_heads=4, ffn=18944, vocab=1000, seq_len=4096)
QWEN2 = dataclasses.replace(QWEN2, qkv_bias=True)


def test_biases_split_with_their_weights_and_qk_norms_replicated():
    plain = dataclasses.replace(QWEN2, qkv_bias=False)
    for tp, kv_local in ((1, 512), (2, 256), (8, 128)):  # tp 8 > 4 kv heads: one kv head each
        with_bias = layer_params_per_rank(QWEN2, False, tp, 1)
        without = layer_params_per_rank(plain, False, tp, 1)
        assert with_bias.dense - without.dense == 3584 / tp + 2 * kv_local
        assert with_bias.replicated == without.replicated == 2 * 3584
    qwen3 = dataclasses.replace(plain, qk_norm=True)
    normed = layer_params_per_rank(qwen3, False, 2, 1)
    assert normed.replicated - layer_params_per_rank(plain, False, 2, 1).replicated == 2 * 128
    assert normed.dense == layer_params_per_rank(plain, False, 2, 1).dense


def test_qk_norm_inputs_in_the_fused_kernel_model():
    plain = dataclasses.replace(QWEN2, qkv_bias=False)
    qwen3 = dataclasses.replace(plain, qk_norm=True)
    plan = ParallelPlan(precision="bf16-mixed", micro_batch=2, tp=2)
    extra = layer_activation_bytes(qwen3, plan) - layer_activation_bytes(plain, plan)
    # bf16 (2 bytes), s b = 8192 tokens, local q 3584 / 2 and k 512 / 2 wide
    assert extra == 2 * 8192 * (1792 + 256)
    assert layer_activation_bytes(QWEN2, plan) == layer_activation_bytes(plain, plan)
