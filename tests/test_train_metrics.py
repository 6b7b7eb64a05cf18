"""MFU arithmetic, the device peak table lookup, and the CPU peak-memory counter."""

from __future__ import annotations

import pytest
import torch

from fivefold.train.memory import StorageCounter, track_cpu_peak
from fivefold.train.metrics import ThroughputMeter, utilization
from fivefold.train.peak import catalog_key_for_cuda, cuda_peak, device_peak


def test_utilization_by_hand():
    # 1,000 tokens/s x 6e9 FLOP/token = 6e12 FLOP/s on 2 devices of 10 TFLOP/s: 30%.
    assert utilization(1000.0, 6e9, 10e12, 2) == pytest.approx(0.30)
    assert utilization(1000.0, 6e9, None, 2) is None


def test_throughput_meter_sums_counted_steps():
    meter = ThroughputMeter()
    meter.add(1000, 0.5)
    meter.add(1000, 1.5)
    assert meter.tokens_per_s == pytest.approx(1000.0)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", None),  # lower peak than the SXM part: not guessed
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA B200", "b200"),
        ("Tesla T4", None),
    ],
)
def test_cuda_device_names_map_to_catalog(name, key):
    assert catalog_key_for_cuda(name) == key


def test_cuda_peak_values_come_from_the_catalog():
    peak = cuda_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert peak.flops_per_s == pytest.approx(989.4e12)
    assert "H100" in peak.source
    unknown = cuda_peak("Tesla T4", "bf16")
    assert not unknown.known and unknown.label.startswith("unknown peak")


def test_cpu_peak_is_measured_and_labelled():
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.known and peak.flops_per_s > 1e8  # any CPU of this century exceeds 0.1 GFLOP/s
    assert peak.label.startswith("measured CPU fp32 matmul peak")


def test_storage_counter_peak_and_frees():
    counter = StorageCounter()
    with counter:
        a = torch.empty(1000)  # 4,000 B
        b = torch.empty(2000)  # 8,000 B -> 12,000 live
        view = b[:10]  # same storage: not counted again
        del a  # back to 8,000
        c = torch.empty(500)  # 10,000
    assert counter.peak_bytes == 12_000
    assert counter.current_bytes == 10_000
    assert view.numel() == 10 and c.numel() == 500


def test_step_peak_counts_weights_grads_and_adam_state():
    model = torch.nn.Linear(256, 256, bias=False)  # 65,536 params = 262,144 B
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 256)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track_cpu_peak([model], opt) as reading:
        model(x).sum().backward()
        opt.step()
    # before: weight + m + v (+ a scalar step); during: + the gradient, + AdamW temporaries.
    assert reading.start_bytes == 3 * 262_144 + 4
    assert reading.peak_bytes >= 4 * 262_144
    assert reading.peak_bytes <= 8 * 262_144
