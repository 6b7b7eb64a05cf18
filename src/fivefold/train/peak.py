"""The peak FLOP/s an MFU figure is measured against.

CUDA devices are looked up by name in the catalog `fivefold.spec.hardware.GPUS` (dense vendor
figures, each with its datasheet as source); a device the catalog does not know gets "unknown
peak" and no MFU, never a guess. A CPU has no catalog figure: with a device profile
(`fivefold calibrate`, named by the recipe's `cluster.profile` or found at the default location)
the peak is the profile's best measured matmul rate per rank, the same figure the planner's MFU
uses; without one we measure one at start-up: the best of a few square matmuls in the compute
dtype, with the threads torch uses. MFU on CPU is therefore "relative to the measured matmul
peak" and labelled so wherever it is printed. A run keeps one peak from start to end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fivefold.planner.lever_costs import mfu_peak
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.hardware import GPUS, catalog_key_for_device
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import recipe

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DevicePeak:
    """A dense peak in FLOP/s (None when unknown) and how it was obtained."""

    flops_per_s: float | None
    dtype: str  # "fp32" | "bf16" | ...
    label: str  # printed next to MFU, e.g. "h100-sxm dense bf16 peak"
    source: str  # datasheet citation or measurement description

    @property
    def known(self) -> bool:
        return self.flops_per_s is not None and self.flops_per_s > 0


def catalog_key_for_cuda(device_name: str) -> str | None:
    """Catalog key for a CUDA device name such as 'NVIDIA H100 80GB HBM3', or None
    (`fivefold.spec.hardware.catalog_key_for_device`, the one mapping)."""
    return catalog_key_for_device(device_name)


def cuda_peak(device_name: str, dtype: str) -> DevicePeak:
    key = catalog_key_for_cuda(device_name)
    if key is None or dtype not in GPUS[key].peak_flops:
        return DevicePeak(None, dtype, f"unknown peak ({device_name})", "not in the GPU catalog")
    spec = GPUS[key]
    return DevicePeak(spec.peak_flops[dtype], dtype, f"{key} dense {dtype} peak", spec.source)


def measure_matmul_flops(
    dtype: str = "fp32", size: int = 1024, min_repeats: int = 5, budget_s: float = 0.3
) -> float:
    """Best FLOP/s of (size x size) @ (size x size) CPU matmuls (2 * size^3 FLOPs each).

    Repeats at least `min_repeats` times and until `budget_s` has passed (at most 50 times):
    the best of many is the least disturbed by other processes sharing the cores.
    """
    torch_dtype = TORCH_DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(torch_dtype)
    b = torch.randn(size, size, generator=gen).to(torch_dtype)
    torch.mm(a, b)  # warm-up: thread pool, packing buffers
    best_s, started, repeats = float("inf"), time.perf_counter(), 0
    while repeats < min_repeats or (time.perf_counter() - started < budget_s and repeats < 50):
        tick = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - tick)
        repeats += 1
    return 2.0 * size**3 / best_s


# Best CPU matmul FLOP/s measured so far in this process, per (dtype, threads).
_best_cpu_flops: dict[tuple[str, int], float] = {}


def cpu_peak(dtype: str, refresh: bool = False) -> DevicePeak:
    """The best matmul rate measured so far (measured now if never, or again if `refresh`).

    On a machine shared with other work one measurement can land in a busy moment; the loop
    refreshes it now and then (a short re-measurement) and the best figure so far stands.
    """
    threads = torch.get_num_threads()
    key = (dtype, threads)
    if refresh or key not in _best_cpu_flops:
        measured = measure_matmul_flops(dtype, budget_s=0.1 if key in _best_cpu_flops else 0.3)
        _best_cpu_flops[key] = max(_best_cpu_flops.get(key, 0.0), measured)
    flops = _best_cpu_flops[key]
    return DevicePeak(
        flops,
        dtype,
        f"measured CPU {dtype} matmul peak ({flops / 1e9:.0f} GFLOP/s, {threads} threads)",
        "best 1024^3 torch.mm rate measured in this process (start-up, then re-checked)",
    )


def profile_peak(cluster: ClusterSpec, dtype: str) -> DevicePeak:
    """The calibrated peak of one of the cluster's ranks from its device profile."""
    spec = cluster.device
    where = f"profile {cluster.profile}"
    if dtype not in spec.peak_flops:
        return DevicePeak(None, dtype, f"unknown peak ({where} has no {dtype} matmul)", where)
    flops = spec.peak(dtype)
    threads = spec.measured.threads if spec.measured is not None else 0
    return DevicePeak(
        flops,
        dtype,
        f"calibrated CPU {dtype} matmul peak ({flops / 1e9:.0f} GFLOP/s per rank, {threads} "
        f"thread(s); {where})",
        spec.source,
    )


def cuda_fp8_peak(device_name: str, model: ModelSpec, plan: ParallelPlan) -> DevicePeak:
    """The peak a step with `plan.fp8` linears is measured against: the FP8 share of its
    FLOPs at the FP8 peak, the rest at the recipe's (`fivefold.planner.lever_costs.mfu_peak`,
    the planner's own count), so MFU = (F8 / P8 + F16 / P16) / step time per GPU."""
    dtype = recipe(plan.precision).compute_dtype
    key = catalog_key_for_cuda(device_name)
    if key is None or "fp8" not in GPUS[key].peak_flops or dtype not in GPUS[key].peak_flops:
        return DevicePeak(None, "fp8", f"unknown fp8 peak ({device_name})", "not in the catalog")
    spec = GPUS[key]
    return DevicePeak(
        mfu_peak(model, plan, spec),
        "fp8",
        f"{key} dense peak, fp8 for the converted linears' FLOPs and {dtype} for the rest",
        spec.source,
    )


def device_peak(
    device: torch.device, dtype: str, refresh: bool = False, cluster: ClusterSpec | None = None
) -> DevicePeak:
    """The dense peak of `device` for compute dtype `dtype` ("fp32", "bf16", ...): a CPU with a
    calibrated `cluster.profile` reads it; otherwise `refresh` re-measures a CPU (catalog
    figures never change)."""
    if device.type == "cuda":
        return cuda_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu" and cluster is not None and cluster.profile:
        return profile_peak(cluster, dtype)
    if device.type == "cpu" and dtype in TORCH_DTYPES:
        return cpu_peak(dtype, refresh)
    return DevicePeak(None, dtype, f"unknown peak ({device.type})", "no measurement")
