"""MFU arithmetic, the device peak table lookup, and the CPU peak-memory counter."""

from __future__ import annotations

import pytest
import torch

from fivefold.train.memory_counter import StorageCounter, track_cpu_peak
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
        ("NVIDIA H100 PCIe", "h100-pcie"),  # its own, lower peak: never the SXM part's
        ("NVIDIA GB200", "gb200"),  # not read as B200
        ("NVIDIA H20", "h20"),
        ("NVIDIA H200 NVL", "h200-nvl"),  # the PCIe H200: its own, lower peak
        ("NVIDIA GH200 480GB", "gh200"),  # 96 GB of HBM3 (480 GB is the Grace's memory)
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


def test_cpu_mfu_basis_without_a_profile_is_one_fixed_stated_figure(monkeypatch):
    """It was measured at each start (154, 207, 215 GFLOP/s for one recipe; 29 vs 87 under
    load), so MFU changed from run to run: now a fixed reference per thread, said so."""
    from fivefold.train.peak import CPU_REFERENCE_FLOPS_PER_THREAD

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    peaks = [device_peak(torch.device("cpu"), "fp32") for _ in range(3)]
    assert {p.flops_per_s for p in peaks} == {3 * CPU_REFERENCE_FLOPS_PER_THREAD} == {288e9}
    assert peaks[0].label.startswith("fixed CPU reference 288 GFLOP/s per rank (3 thread(s) x 96")
    assert "no device profile" in peaks[0].label


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


def test_tensorboard_writer_logs_finite_scalars(tmp_path, monkeypatch):
    import sys
    import types

    from fivefold.train.metrics import StepMetrics, TensorBoardWriter

    calls = []

    class FakeSummaryWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("closed",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    writer = TensorBoardWriter(tmp_path / "tb")
    assert writer.available
    m = StepMetrics(
        step=7,
        loss=2.5,
        grad_norm=0.5,
        lr=1e-3,
        tokens=1024,
        step_time_s=0.5,
        tokens_per_s=2048.0,
        mfu=None,
        hfu=None,
        peak_memory_bytes=100,
        elapsed_s=3.0,
    )
    writer.write(m)
    writer.close()
    scalars = {c[0]: (c[1], c[2]) for c in calls if len(c) == 3}
    assert scalars["train/loss"] == (2.5, 7) and scalars["train/lr"] == (1e-3, 7)
    assert "train/mfu" not in scalars  # unknown peak: nothing logged rather than a guess
    assert calls[0] == ("dir", str(tmp_path / "tb")) and calls[-1] == ("closed",)


def test_tensorboard_writer_without_tensorboard(tmp_path, monkeypatch):
    import sys

    from fivefold.train.metrics import TensorBoardWriter

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises
    writer = TensorBoardWriter(tmp_path / "tb")
    assert not writer.available
    writer.close()


def test_jsonl_resume_drops_records_after_the_checkpoint(tmp_path):
    import json

    from fivefold.train.metrics import JsonlWriter

    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    for step in range(1, 6):
        writer.write({"step": step})
    writer.close()
    with path.open("a") as f:
        f.write('{"step": 6, "lo')  # cut short by a crash
    writer = JsonlWriter(path, keep_through_step=3)  # resumed from the step-3 checkpoint
    writer.write({"step": 4, "again": True})
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"step": 1}, {"step": 2}, {"step": 3}, {"step": 4, "again": True}]
