"""Device rates (`planner.rates.device`): the catalog and the measured implementation of one
interface, each against numbers derived by hand for a simple device."""

from __future__ import annotations

import math
import tomllib

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.rates.device import CatalogRates, MeasuredRates, rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.comm import all_reduce_time_s, p2p_time_s
from fivefold.planner.step_time.compute import ComputeOptions
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.hardware import GPUSpec, measured_gpu
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import (
    Attention,
    Bandwidth,
    Collective,
    DeviceProfile,
    Matmul,
    Overhead,
    RankProfile,
)

EFF = EfficiencyModel(
    gemm_peak_fraction=(("hopper", 0.8),),
    gemm_half_intensity=0.5,
    attention_peak_fraction=0.5,
    attention_backward_ratio=2.5,
    hbm_fraction=0.8,
    layer_overhead_s=10e-6,
)
# 100 TFLOP/s bf16 over 1 TB/s: the ridge at 100 FLOP/byte
GPU = GPUSpec("test-gpu", 80 * 2**30, {"bf16": 100e12}, 1e12, 0.0, arch="hopper")
N = 512  # the measured device's one GEMM shape: 2 N^3 FLOPs
PROFILE = DeviceProfile(
    name="test-cpu",
    kind="cpu",
    cores=2,
    memory_bytes=8 * 2**30,
    backend="gloo",
    ranks=2,
    matmul=(
        Matmul("fp32", 1, N, N, N, "nt", 2e10),
        Matmul("fp32", 1, N, N, N, "nn", 1e10),
        Matmul("fp32", 1, N, N, N, "tn", 5e9),
    ),
    attention=(Attention("fp32", 1, 1, 1, 1, 128, 64, 1, 1e9, 5e8),),
    bandwidth=(Bandwidth("elementwise_forward", 1, 2, 1e9),),
    overhead=(Overhead(1, 1e-3, 2e-3, *([0.0] * 12)),),
    collective=(
        Collective("all_reduce", 2, 2, 0.0, 1e-4, 1e9),
        Collective("send_recv", 2, 2, 0.0, 2e-4, 2e9),
    ),
)


def test_catalog_rates_by_hand():
    """A 1000^3 bf16 GEMM: intensity 2e9 / (2 * 3e6) = 1000/3 FLOP/byte, fraction 0.8 * I /
    (I + 0.5 * 100) = 0.8 * 1000/1150, so 2e9 / (1e14 * 0.8 * 1000/1150) = 28.75 us; every
    backward pass the same; streaming at 0.8 TB/s; attention at half the peak, backward 2.5x;
    10 us of overhead forward, twice backward."""
    rates = rates_for(GPU, EFF)
    assert isinstance(rates, CatalogRates) and not rates.calibrated
    assert rates.gemm_s(1000, 1000, 1000, "bf16") == pytest.approx(2.875e-5)
    assert rates.gemm_passes_s(1000, 1000, 1000, "bf16") == pytest.approx((2.875e-5,) * 3)
    assert rates.gemm_s(0, 1000, 1000) == 0.0
    assert 1e9 / rates.stream_bytes_per_s("loss_forward") == pytest.approx(1.25e-3)
    assert rates.attention_s(1e12, 4096, 128, "bf16", 1, 32) == pytest.approx((0.02, 0.05))
    assert rates.layer_overhead_s(True, True, 3, 2, True) == pytest.approx((10e-6, 20e-6))
    assert rates.local_link(8, None) is None
    assert rates.collective_gap_s(lambda: 1.0) is None
    assert rates.shared_cores_step_s(2, [1.0], 0.1, 0.1) == math.inf
    assert rates.runtime_options() == {}


def test_measured_rates_by_hand():
    """Two one-thread ranks on two cores (share 1): each pass of the 512^3 GEMM at its layout's
    measured rate, 2 * 512^3 = 268,435,456 FLOPs at 20, 10 and 5 GFLOP/s; 1 GB streamed in 1 s;
    attention 1 GFLOP in 1 s forward, 2 GFLOP at 0.5 GFLOP/s backward; the measured overhead;
    an all-reduce of 1 MB in 0.1 ms + 1 MB / 1 GB/s, a send of 2 MB in 0.2 ms + 1 ms."""
    rates = rates_for(measured_gpu(RankProfile.of(PROFILE, 2, threads=1)), EFF)
    assert isinstance(rates, MeasuredRates) and rates.calibrated
    flops = 2 * N**3
    passes = rates.gemm_passes_s(N, N, N, "fp32")
    assert passes == pytest.approx((flops / 2e10, flops / 1e10, flops / 5e9))
    assert 1e9 / rates.stream_bytes_per_s("elementwise_forward") == pytest.approx(1.0)
    assert rates.attention_s(1e9, 128, 64, "fp32", 1, 0.0) == pytest.approx((1.0, 4.0))
    assert rates.layer_overhead_s() == pytest.approx((1e-3, 2e-3))
    link = rates.local_link(2, None)
    assert link.kind == "gloo" and not link.hides_transfers
    assert all_reduce_time_s(1e6, 2, link) == pytest.approx(1e-4 + 1e-3)
    assert p2p_time_s(2e6, link) == pytest.approx(2e-4 + 1e-3)
    assert rates.collective_gap_s(lambda: 0.4) == pytest.approx(0.2)
    assert rates.runtime_options() == {
        "cuda_context_bytes": 0.0,
        "fragmentation_fraction": 0.0,
        "dp_overlap": False,
    }  # a CPU's own facts; fivefold's runtime's are every device's (`RUNTIME_FACTS`)


def test_measured_rates_share_the_cores():
    """Four one-thread ranks on two cores: half the machine each, so every rate halves and every
    fixed second doubles; the step with cores that never idle is every rank's compute at full
    speed over the cores (4 ranks x 1 s x 0.5 x 1 thread / 2 cores) plus the rest at the share."""
    rates = rates_for(measured_gpu(RankProfile.of(PROFILE, 4, threads=1)))
    flops = 2 * N**3
    assert rates.gemm_s(N, N, N, "fp32") == pytest.approx(flops / 1e10)
    assert rates.layer_overhead_s() == pytest.approx((2e-3, 4e-3))
    assert rates.shared_cores_step_s(4, [1.0], 0.2, 0.1) == pytest.approx(1.0 + 0.1 + 0.1)


def test_measured_rates_ignore_kernel_choices_the_profile_measured():
    """The profile timed the runtime's own attention and element-wise kernels."""
    opts = ComputeOptions(attention_kernel="classic", fused_elementwise=False)
    measured = rates_for(measured_gpu(RankProfile.of(PROFILE, 2, threads=1)))
    assert measured.kernel_options(opts) == ComputeOptions()
    assert rates_for(GPU, EFF).kernel_options(opts) is opts


def test_offload_on_a_measured_gpu_is_an_error():
    cuda = DeviceProfile(**{**PROFILE.__dict__, "kind": "cuda"})
    rates = rates_for(measured_gpu(RankProfile.of(cuda, 1)))
    with pytest.raises(ConfigError, match="no PCIe or host-memory figures"):
        rates.check_offload(ParallelPlan(offload="optimizer"), ClusterSpec())


def test_packed_attention_rows_are_read_beside_not_by_the_planner():
    """A profile's packed-kernel rows (varlen, flex, the document op) leave the planner's
    attention rates on the one-document rows; a profile written before the `kernel` field reads
    as one-document SDPA."""
    from dataclasses import replace

    from fivefold.specs.profile import BANDWIDTH_KINDS, parse_profile

    packed = Attention("fp32", 1, 4, 1, 1, 32, 64, 1, 1e12, 1e12, "document_attention")
    streams = tuple(Bandwidth(kind, 1, 2, 1e9) for kind in BANDWIDTH_KINDS)
    both = replace(PROFILE, attention=(*PROFILE.attention, packed), bandwidth=streams)
    rates = rates_for(measured_gpu(RankProfile.of(both, 2, threads=1)), EFF)
    assert rates.attention_s(1e9, 128, 64, "fp32", 1, 0.0) == pytest.approx((1.0, 4.0))

    data = tomllib.loads(both.to_toml())
    assert [row["kernel"] for row in data["attention"]] == ["sdpa", "document_attention"]
    del data["attention"][0]["kernel"]
    assert parse_profile(data).attention == both.attention
