"""Which kernels calibrate times from cold caches: GEMMs warm on a CPU, everything cold on a GPU."""

from __future__ import annotations

import torch

from fivefold.calibration import matmul, timing


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
