"""Calibrate times kernels as a run runs them: a CPU's GEMMs with warm caches (a GPU's and the
other kernels cold), and AdamW with the kernel training picks."""

from __future__ import annotations

import torch

from fivefold.calibration import bandwidth, matmul, timing
from fivefold.specs.presets import model_preset
from fivefold.train.optim import kernel_choice


def _count_flushes(monkeypatch) -> list[int]:
    flushes = [0]

    def flush() -> None:
        flushes[0] += 1

    monkeypatch.setattr(timing, "flush_caches", flush)
    return flushes


def test_cpu_gemms_are_timed_warm_and_other_kernels_cold(monkeypatch):
    flushes = _count_flushes(monkeypatch)
    budget = timing.Budget(3, 3, 0.0)
    row = matmul.measure_matmul((64, 32, 16, "tn"), "fp32", 1, budget)
    assert (row.m, row.n, row.k, row.layout) == (64, 32, 16, "tn")
    assert flushes[0] == 0  # a step's GEMMs find their operands in the caches
    grouped = matmul.measure_grouped((2, 32, 16, 8), "fp32", 1, budget)
    assert [g.layout for g in grouped] == ["nt", "nn", "tn"] and flushes[0] == 0
    timing.typical_time_s(lambda: torch.ones(4).sum(), budget)
    assert flushes[0] == 3  # the default: one flush before each of the 3 repeats


def test_gpu_gemms_stay_cold(monkeypatch):
    assert timing.gemm_caches_cold() is False
    monkeypatch.setattr(timing, "_device", torch.device("cuda"))
    assert timing.gemm_caches_cold() is True


def test_the_optimizer_is_timed_with_the_kernel_training_uses(monkeypatch):
    built = []
    adamw = torch.optim.AdamW

    def recording(params, **kwargs):
        built.append((list(params), kwargs))
        return adamw(built[-1][0], **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    model = model_preset("tiny").with_(layers=1)
    seconds, params = bandwidth.optimizer_time_s(model, timing.Budget(1, 1, 0.0))
    ((tensors, kwargs),) = built
    assert seconds > 0 and params == sum(t.numel() for t in tensors)
    assert kwargs["fused"] is True  # on a CPU, as training builds it
    assert {k: v for k, v in kwargs.items() if k in ("fused", "foreach")} == kernel_choice(
        [{"params": tensors}]
    )
