"""The peak FLOP/s an MFU figure is measured against.

CUDA devices are looked up by name in the catalog `fivefold.specs.hardware.GPUS` (dense vendor
figures, each with its datasheet as source); a device the catalog does not know gets "unknown
peak" and no MFU, never a guess. A CPU has no catalog figure: with a device profile
(`fivefold calibrate`, named by the recipe's `cluster.profile` or found at the default location)
the peak is the profile's best measured matmul rate per rank, the same figure the planner's MFU
uses; without one it is a fixed reference per thread (`CPU_REFERENCE_FLOPS_PER_THREAD`), the
same in every run, so MFU compares across runs. The basis is labelled wherever MFU is printed.
A run keeps one peak from start to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.planner.step_time.lever_costs import mfu_peak
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.hardware import GPUS, catalog_key_for_device
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe

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
    (`fivefold.specs.hardware.catalog_key_for_device`, the one mapping)."""
    return catalog_key_for_device(device_name)


def cuda_peak(device_name: str, dtype: str) -> DevicePeak:
    key = catalog_key_for_cuda(device_name)
    if key is None or dtype not in GPUS[key].peak_flops:
        return DevicePeak(None, dtype, f"unknown peak ({device_name})", "not in the GPU catalog")
    spec = GPUS[key]
    return DevicePeak(spec.peak_flops[dtype], dtype, f"{key} dense {dtype} peak", spec.source)


# Without a device profile, a CPU's MFU is against this fixed reference per thread the rank
# uses, not a measurement: a peak measured at each start differed by 40 % between runs of one
# recipe (and by 3x under load), so MFU could not be compared from run to run. The figure is
# the fp32 FMA rate of one AVX2 core at 3 GHz (2 FMA units x 8 lanes x 2 FLOPs x 3e9); a
# profile's measured peak replaces it (`fivefold calibrate`).
CPU_REFERENCE_FLOPS_PER_THREAD = 96e9


def cpu_peak(dtype: str) -> DevicePeak:
    """The fixed reference `CPU_REFERENCE_FLOPS_PER_THREAD` x this process's torch threads."""
    threads = torch.get_num_threads()
    flops = CPU_REFERENCE_FLOPS_PER_THREAD * threads
    return DevicePeak(
        flops,
        dtype,
        f"fixed CPU reference {flops / 1e9:.0f} GFLOP/s per rank ({threads} thread(s) x "
        f"{CPU_REFERENCE_FLOPS_PER_THREAD / 1e9:.0f}; no device profile, so not this CPU's "
        "measured peak)",
        "one AVX2 core's fp32 FMA rate at 3 GHz per thread (fivefold.train.peak)",
    )


def profile_peak(cluster: ClusterSpec, dtype: str) -> DevicePeak:
    """The calibrated peak of one of the cluster's ranks from its device profile."""
    spec = cluster.device
    where = f"profile {cluster.profile}"
    if dtype not in spec.peak_flops:
        return DevicePeak(None, dtype, f"unknown peak ({where} has no {dtype} matmul)", where)
    flops = spec.peak(dtype)
    threads = spec.rank_profile.threads if spec.rank_profile is not None else 0
    return DevicePeak(
        flops,
        dtype,
        f"calibrated CPU {dtype} matmul peak ({flops / 1e9:.0f} GFLOP/s per rank, {threads} "
        f"thread(s); {where})",
        spec.source,
    )


def cuda_fp8_peak(device_name: str, model: ModelSpec, plan: ParallelPlan) -> DevicePeak:
    """The peak a step with `plan.fp8` linears is measured against: the FP8 share of its
    FLOPs at the FP8 peak, the rest at the recipe's (`planner.step_time.lever_costs.mfu_peak`,
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


def device_peak(device: torch.device, dtype: str, cluster: ClusterSpec | None = None) -> DevicePeak:
    """The dense peak of `device` for compute dtype `dtype` ("fp32", "bf16", ...): a CPU with a
    calibrated `cluster.profile` reads it; another CPU gets the fixed reference (`cpu_peak`)."""
    if device.type == "cuda":
        return cuda_peak(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu" and cluster is not None and cluster.profile:
        return profile_peak(cluster, dtype)
    if device.type == "cpu" and dtype in TORCH_DTYPES:
        return cpu_peak(dtype)
    return DevicePeak(None, dtype, f"unknown peak ({device.type})", "no measurement")
