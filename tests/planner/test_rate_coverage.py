"""Which rates a plan reads inside a measured device's shapes and which beyond
(`fivefold.planner.rates.coverage`, `shape_interp`), on a synthetic profile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fivefold.calibration.matmul import device_grid_shapes
from fivefold.planner.rates.coverage import coverage
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.shape_interp import beyond_range, log_shape_interp
from fivefold.specs import ParallelPlan, model_preset
from fivefold.specs.hardware import measured_gpu
from fivefold.specs.profile import (
    Attention,
    Bandwidth,
    CollectiveSample,
    DeviceProfile,
    Matmul,
    Overhead,
    RankProfile,
)

SIDES = (64, 256, 1024)  # every (m, n, k) of the grid, each layout at 1e10 x (m / 64) FLOP/s
PROFILE = DeviceProfile(
    name="grid-cpu",
    kind="cpu",
    cores=1,
    memory_bytes=8 * 2**30,
    backend="gloo",
    ranks=1,
    matmul=tuple(
        Matmul("fp32", 1, m, n, k, layout, 1e10 * m / 64)
        for m in SIDES
        for n in SIDES
        for k in SIDES
        for layout in ("nt", "nn", "tn")
    ),
    attention=tuple(
        Attention("fp32", 1, b, 4, 4, s, d, 1, 1e9, 5e8)
        for b in (1, 4)
        for s in (128, 1024)
        for d in (16, 64)
    ),
    bandwidth=(Bandwidth("elementwise_forward", 1, 1, 1e9),),
    overhead=(Overhead(1, 1e-3, 2e-3, *([0.0] * 12)),),
)
RATES = rates_for(measured_gpu(RankProfile.of(PROFILE, 1, threads=1)))
# h 256, q 256 (4 heads of 64), kv 256, SwiGLU 1024, vocab 1024, seq 256: inside the grid
INSIDE = model_preset("tiny").with_(
    hidden=256, heads=4, kv_heads=4, head_dim=64, ffn=1024, vocab=1024, seq_len=256
)
FP32 = ParallelPlan(micro_batch=1, precision="fp32")


def test_beyond_range_names_each_coordinate_outside():
    points = [((64.0, 64.0), 1.0), ((1024.0, 256.0), 2.0)]
    assert beyond_range((100.0, 100.0), points, "m n") == ()
    assert beyond_range((2048.0, 32.0), points, "m n") == ("m 2048 > 1024", "n 32 < 64")
    # the rate beyond is the edge's: m clamped to 1024, n to 64
    assert log_shape_interp((2048.0, 32.0), points) == log_shape_interp((1024.0, 64.0), points)


def test_a_model_inside_the_grid_is_interpolated_or_measured():
    """Seven eager matmuls (wq, wk, wv, wo, w1, w3, w2) and the LM head are three shapes here
    (256 x 256 x 256; 256 x 1024 x 256 for w1, w3 and the head; 256 x 256 x 1024 for w2),
    three passes each: 9 reads, every coordinate a grid side, so all measured; attention
    (seq 256, head width 64, 4 rows) between grid points."""
    cov = coverage(RATES, INSIDE, FP32)
    assert cov.count("GEMM passes") == (9, 0, 0)
    assert cov.count("attention") == (0, 1, 0)
    assert not cov.extrapolated
    assert cov.describe() == "Device model: GEMM passes 9 measured; attention 1 interpolated."


def test_a_wider_longer_model_is_flagged_extrapolated():
    """Hidden 512 stays inside; seq 4096 at micro-batch 1 puts m = 4096 tokens beyond the
    grid's 1024 in every forward and input-gradient pass (k in the weight gradient), and the
    attention's 4096 tokens beyond its 1024."""
    wide = INSIDE.with_(hidden=512, heads=8, kv_heads=8, seq_len=4096)
    cov = coverage(RATES, wide, FP32)
    measured, inside, beyond = cov.count("GEMM passes")
    assert (measured, inside, beyond) == (0, 0, 9)
    far = {r.shape: r.beyond for r in cov.reads}
    assert far["4096 x 512 x 512 nt"] == ("m 4096 > 1024",)
    assert far["512 x 512 x 4096 tn"] == ("k 4096 > 1024",)
    assert far["4096 x 64 x 8"] == ("seq 4096 > 1024",)  # 8 rows: between 4 and 16
    text = cov.describe()
    assert "GEMM passes 9 EXTRAPOLATED (the measured edge's rate: 4096 x 512 x 512 nt" in text
    assert "attention 1 EXTRAPOLATED" in text


def test_the_rate_read_matches_the_table_it_is_flagged_against():
    """A measured shape reads its own row (scaled to the rank); the flagged points are the ones
    the rate is read from."""
    points, scale = RATES.gemm_points("fp32", "nt")
    assert len(points) == 27 and scale == pytest.approx(1.0)
    assert RATES.gemm_flops_per_s(256, 64, 1024, "fp32", "nt") == pytest.approx(4e10)
    half = replace(FP32, micro_batch=2)
    assert coverage(RATES, INSIDE, half).count("GEMM passes")[2] == 0  # m 512: inside


def test_experts_without_grouped_rows_are_read_as_gemms():
    """A profile without grouped rows times each expert as its own GEMM: 8 experts top-2 over
    256 tokens give 64 rows per expert (the grid's lowest m), w1/w3 (64 x 128 x 256) and w2
    (64 x 256 x 128), three passes each: six reads, inside the grid (128 between its 64 and 256)."""
    moe = INSIDE.with_(experts=8, top_k=2, expert_ffn=128, shared_experts=0)
    cov = coverage(RATES, moe, FP32)
    assert cov.count("experts as GEMMs") == (0, 6, 0)
    wide = moe.with_(experts=32)  # 16 rows per expert: m 16 < 64 forward
    far = {r.shape: r.beyond for r in coverage(RATES, wide, FP32).reads_of("experts as GEMMs")}
    assert far["16 x 128 x 256 nt"] == ("m 16 < 64",)


def test_the_quick_cpu_grid_brackets_a_small_moe_s_experts():
    """A profile holding only `calibrate --quick`'s CPU device grid reads a small MoE's experts
    (h 128, 8 experts top-2 over 512 tokens: 128 rows per expert, expert FFN 352) between its
    measured shapes, not at the edge's rate (the grid once started at m = 256, and those
    experts were predicted up to a quarter fast)."""
    grid = tuple(
        Matmul("fp32", 1, m, n, k, layout, 1e10)
        for m, n, k, layout in device_grid_shapes("cpu", True)
    )
    rates = rates_for(measured_gpu(RankProfile.of(replace(PROFILE, matmul=grid), 1, threads=1)))
    moe = INSIDE.with_(
        hidden=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        experts=8,
        top_k=2,
        expert_ffn=352,
        shared_experts=0,
        seq_len=256,
    )
    cov = coverage(rates, moe, replace(FP32, micro_batch=2))
    assert cov.count("experts as GEMMs") == (0, 6, 0)
    assert cov.count("GEMM passes")[2] == 3  # only the router's 8 outputs lie below 64


def test_collectives_beyond_the_largest_measured_size_are_flagged():
    """Samples at 4 KiB, 1 MiB and 16 MiB over 2 of 4 processes. Hidden 1024 (16 heads of 64),
    SwiGLU 4096, fp32, TP2+SP, ZeRO-3 over 2: TP's activations are 256 tokens x 1024 x 4 B =
    1 MiB (a measured size); a block's gradients on a TP rank are (4 x 1024^2 + 3 x 1024 x
    4096) / 2 weights + 2 x 1024 norm weights = 8,390,656 x 4 B = 32.0 MiB, beyond 16 MiB, in
    the reduce-scatter and the all-gather."""
    samples = tuple(
        CollectiveSample(op, 2, 4, 0.0, size, 1e-3 + size / 1e9, 1.0, 1.0)
        for op in ("all_gather", "reduce_scatter", "all_reduce")
        for size in (4 * 1024, 2**20, 16 * 2**20)
    )
    profile = replace(PROFILE, collective_sample=samples)
    rates = rates_for(measured_gpu(RankProfile.of(profile, 4, threads=1)))
    wide = INSIDE.with_(hidden=1024, heads=16, kv_heads=16, head_dim=64, ffn=4096)
    plan = replace(FP32, tp=2, sp=True, dp_shard=2, zero=3)
    cov = coverage(rates, wide, plan)
    far = {r.shape: (r.measured, r.beyond) for r in cov.reads_of("collectives")}
    assert far == {
        "all_gather of 1 MiB over 2": (True, ()),
        "reduce_scatter of 1 MiB over 2": (True, ()),
        "reduce_scatter of 32 MiB over 2": (False, ("size 32 > 16 MiB",)),
        "all_gather of 32 MiB over 2": (False, ("size 32 > 16 MiB",)),
    }
    assert "collectives 2 measured, 2 EXTRAPOLATED (the largest measured size's time" in (
        cov.describe()
    )
    # a profile without size samples prices every size on its fitted line: nothing to flag
    assert coverage(RATES, wide, plan).reads_of("collectives") == []
