"""The machine at hand: its CPU (name, flags, bf16), its memory, the thread counts to measure."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

from fivefold.calibration.timing import measured_device
from fivefold.parallel.device import real_bf16


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return set(match.group(1).split()) if match else set()


def bf16_support() -> str:
    """ "native" when the CPU has AMX-BF16 or AVX512-BF16 (else torch emulates bf16 matmuls,
    often many times slower than fp32: "emulated")."""
    return "native" if cpu_flags() & {"amx_bf16", "avx512_bf16"} else "emulated"


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def measured_device_name() -> str:
    """The name of the device kernels are measured on: the GPU's, else the CPU's."""
    device = measured_device()
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def thread_counts(cores: int) -> list[int]:
    """The per-rank thread counts runs on this machine use: 1 (many ranks) and all cores."""
    return sorted({1, max(1, cores)})


def cuda_bf16_support() -> str:
    """ "native" when the GPU computes bf16 in hardware (Ampere and later), else "emulated"."""
    return "native" if real_bf16() else "emulated"
