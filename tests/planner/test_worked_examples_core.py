"""Every worked number of the distributed-training guides (except the pipeline-bubble table and
the 7B long-context case, tested with the schedule and search), through the planner's public API:
the DeepSeek-V3 book's memory budget, the CS 231n lecture, the 70B deep dive and the MIT 6.5940
lecture.

GB = 1e9 bytes, GiB = 2**30 bytes. Where a guide's arithmetic is off, the test asserts the
corrected value and says why.
"""

from __future__ import annotations

import math

import pytest
from arithmetic import (
    SECONDS_PER_YEAR,
    gemm_intensity,
    heads_per_rank,
    max_params_unsharded,
    min_gpus,
    qkv_params_per_rank,
    ridge_point,
    simple_activation_bytes,
    time_to_train_s,
    training_flops,
    training_memory,
)

from fivefold.planner.memory.model_states import model_state_bytes
from fivefold.planner.step_time.comm import activation_bytes, all_reduce_bytes, transfer_time_s
from fivefold.specs import ModelSpec, ParallelPlan, gpu
from fivefold.specs.precision import recipe

GiB = 2**30
GB = 1e9
H100_80 = 80 * GiB  # the DeepSeek-V3 book's script: H100 = 80 * GB with GB = 2**30


# ---- memory: the four tenants (the DeepSeek-V3 book, simple activation model k = 12) -----------
FOUR_TENANTS = [
    # name, N, L, d, B, S, params, grads, optim, acts, total (GiB), min GPUs
    ("GPT-2 124M", 124e6, 12, 768, 1, 1024, 0.23, 0.23, 1.39, 0.21, 2.06, 1),
    ("Llama-7B", 7e9, 32, 4096, 1, 4096, 13.04, 13.04, 78.23, 12.00, 116.31, 2),
    # The book prints 1249.55 / 7497.32 / 39.13 for DeepSeek-V3; its own formula (the one below,
    # with N = 671e9) gives 1249.83 / 7499.01 / 40.03, which is what we assert.
    ("DeepSeek-V3 671B", 671e9, 61, 7168, 1, 4096, 1249.83, 1249.83, 7499.01, 40.03, 10038.71, 126),
]


@pytest.mark.parametrize(
    "name,n,layers,hidden,batch,seq,params,grads,optim,acts,total,gpus", FOUR_TENANTS
)
def test_four_tenants_simple_model(
    name, n, layers, hidden, batch, seq, params, grads, optim, acts, total, gpus
):
    t = training_memory(
        n, layers=layers, hidden=hidden, micro_batch=batch, seq_len=seq, precision="bf16-mixed"
    )
    assert t.params / GiB == pytest.approx(params, abs=0.005)
    assert t.grads / GiB == pytest.approx(grads, abs=0.005)
    assert t.optimizer / GiB == pytest.approx(optim, abs=0.005)
    assert t.activations / GiB == pytest.approx(acts, abs=0.005)
    assert t.total / GiB == pytest.approx(total, abs=0.01)
    assert min_gpus(t.total, H100_80) == gpus


def test_llama7b_batch4_seq8192_decimal():
    acts = simple_activation_bytes(32, 4096, 4, 8192, 2)
    assert acts / GB == pytest.approx(103.08, abs=0.005)
    t = training_memory(7e9, layers=32, hidden=4096, micro_batch=4, seq_len=8192)
    assert t.total / GB == pytest.approx(215.08, abs=0.005)
    assert min_gpus(t.total, 80 * GB) == 3


def test_deepseek_fp8_recipe():
    fp8 = recipe("fp8-mixed")
    assert fp8.bytes_per_param == 9  # 1 + 2 + 6
    static = model_state_bytes(671e9, fp8).total
    assert static / 1e12 == pytest.approx(6.04, abs=0.005)
    assert min_gpus(static + 31e9, 80 * GB) == 76


def test_sixteen_bytes_per_param_rule():
    assert model_state_bytes(7e9, "bf16-mixed").total == pytest.approx(112e9)
    assert model_state_bytes(70e9, "bf16-mixed").total == pytest.approx(1120e9)
    # Largest model whose state fits one 80 GB GPU without sharding (the MIT 6.5940 lecture): 5B.
    assert max_params_unsharded(80 * GB, "bf16-mixed") == pytest.approx(5e9)


# ---- ZeRO (the MIT 6.5940 lecture, 16 B/param) --------------------------------------------------
@pytest.mark.parametrize(
    "stage,bytes_per_param,gb", [(1, 4.1875, 29.31), (2, 2.21875, 15.53), (3, 0.25, 1.75)]
)
def test_zero_stages_7b_on_64(stage, bytes_per_param, gb):
    per_gpu = model_state_bytes(7e9, "bf16-mixed", zero=stage, shard=64).total
    assert per_gpu / 7e9 == pytest.approx(bytes_per_param)
    assert per_gpu / GB == pytest.approx(gb, abs=0.005)


@pytest.mark.parametrize("n,shard,gb", [(70e9, 128, 8.75), (7e9, 8, 14.0), (70e9, 64, 17.5)])
def test_zero3_examples(n, shard, gb):
    assert model_state_bytes(n, "bf16-mixed", zero=3, shard=shard).total / GB == pytest.approx(gb)


def test_zero3_13b_pp4_dp16():
    # 13B on 64 GPUs: PP = 4 splits the parameters, ZeRO-3 shards each stage over DP = 16.
    plan = ParallelPlan(pp=4, dp_shard=16, zero=3)
    assert plan.world_size == 64
    per_stage = 13e9 / plan.pp
    per_gpu = model_state_bytes(per_stage, "bf16-mixed", zero=3, shard=plan.dp_shard).total
    assert per_gpu / GB == pytest.approx(3.25)


def test_405b_twelve_bytes_per_param():
    twelve = recipe("bf16-no-master")  # 2 + 2 + 8 = 12 B/param (the CS 231n lecture's table)
    assert twelve.bytes_per_param == 12
    assert model_state_bytes(405e9, twelve).total / 1e12 == pytest.approx(4.86)
    per_gpu = model_state_bytes(405e9, twelve, zero=3, shard=1024).total
    assert per_gpu / GB == pytest.approx(4.75, abs=0.005)  # 4.86e12 / 1024 = 4.746e9


@pytest.mark.parametrize("stage,gb", [(0, 84.0), (1, 42.0), (2, 31.5), (3, 21.0)])
def test_deep_dive_7b_on_4_gpus(stage, gb):
    # The 70B deep dive's own tenant sizes: 14 + 14 + 56 GB, i.e. 2 + 2 + 8 B/param.
    per_gpu = model_state_bytes(7e9, "bf16-no-master", zero=stage, shard=4).total
    assert per_gpu / GB == pytest.approx(gb)


# ---- communication (the CS 231n and MIT 6.5940 lectures) -----------------------------------------
def test_ring_all_reduce_volume():
    assert all_reduce_bytes(4 * GB, 8) == pytest.approx(7 * GB)
    # 7B fp16 gradients (14 GB) over 8 ranks: 2 * 7/8 * 14 = 24.5 GB. The MIT lecture's code
    # comment says ~27.6 GB, an arithmetic slip.
    assert all_reduce_bytes(14 * GB, 8) == pytest.approx(24.5 * GB)


def test_tp_all_reduce_405b():
    # One TP all-reduce of the 4M-token activations at hidden 16,384 in bf16: 131 GB (decimal).
    # The CS 231n lecture says 128 GB: the same count read in binary units (2**22 tokens would
    # be 128 GiB).
    per_block = activation_bytes(4e6, 16384, 2)
    assert per_block / GB == pytest.approx(131.07, abs=0.01)
    # 126 blocks x 4 all-reduces per step. Its ~64.5 TB and ~72 s multiply its 128 by
    # 504; with the corrected 131.07 GB the step moves 66.06 TB, 73.4 s at 900 GB/s.
    per_step = 126 * 4 * per_block
    assert per_step / 1e12 == pytest.approx(66.06, abs=0.01)
    assert transfer_time_s(per_step, 900 * GB) == pytest.approx(73.4, abs=0.05)


def test_tp_mlp_all_reduce_small():
    size = activation_bytes(4096, 4096, 2)  # s = 4096 tokens, d = 4096, fp16
    assert size == 32 * 2**20  # 32 MiB
    assert transfer_time_s(size, 600 * GB) * 1e3 == pytest.approx(0.056, abs=0.001)  # ~0.05 ms


# ---- compute (the CS 231n lecture) --------------------------------------------------------------
def test_six_n_d_for_405b():
    flops = training_flops(405e9, 15e12)
    assert flops == pytest.approx(3.645e25)
    h100 = gpu("h100-sxm").peak("bf16")
    years = time_to_train_s(flops, 1, h100) / SECONDS_PER_YEAR
    assert years == pytest.approx(1168, abs=1)
    days = time_to_train_s(flops, 24576, h100) / 86400
    assert days == pytest.approx(17.4, abs=0.05)
    # The CS 231n lecture pairs "17 days" with 40% MFU; at 40% it is 43.4 days (17.4 days is 100%).
    assert time_to_train_s(flops, 24576, h100, mfu=0.4) / 86400 == pytest.approx(43.4, abs=0.05)


def test_arithmetic_intensity_and_ridge():
    assert gemm_intensity(4096, 4096, 4096, 2, include_output=False) == pytest.approx(2048)
    # H100 ridge 989e12 / 3.352e12 = 295 FLOP/byte (the catalog has 3.35 TB/s: 295.3).
    assert ridge_point(gpu("h100-sxm")) == pytest.approx(295, abs=0.5)


# ---- tensor-parallel layout (the 7B long-context case, the MIT 6.5940 lecture) ------------------
def test_qkv_column_parallel_params():
    m = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008)
    assert qkv_params_per_rank(m, 4) == 12_582_912  # 3 * 4096 * 4096 / 4


def test_heads_per_gpu_and_gpu_count():
    m = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008)
    assert heads_per_rank(m, 8) == 4
    assert ParallelPlan(tp=4, pp=4, dp_replicate=16).world_size == 256
    assert math.prod((4, 4, 16)) == 256
