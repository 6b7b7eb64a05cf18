"""Measured rows sorted into tables, and the device profile of this machine built from them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fivefold.calibration.machine import host_memory_bytes, measured_device_name
from fivefold.calibration.timing import measured_device
from fivefold.specs.model import ModelSpec
from fivefold.specs.profile import (
    Attention,
    Bandwidth,
    DeviceProfile,
    GroupedMatmul,
    Matmul,
    Overhead,
    available_cores,
)


@dataclass
class ComputeTables:
    matmul: list[Matmul]
    grouped_matmul: list[GroupedMatmul]
    attention: list[Attention]
    bandwidth: list[Bandwidth]
    overhead: list[Overhead]


def sort_rows(rows: list) -> ComputeTables:
    return ComputeTables(
        [r for r in rows if isinstance(r, Matmul)],
        [r for r in rows if isinstance(r, GroupedMatmul)],
        [r for r in rows if isinstance(r, Attention)],
        [r for r in rows if isinstance(r, Bandwidth)],
        [r for r in rows if isinstance(r, Overhead)],
    )


def build_profile(
    model: ModelSpec,
    ranks: int,
    bf16: str,
    tables: ComputeTables,
    backend: str,
    samples: list,
    collectives: list,
    device_name: str | None = None,
) -> DeviceProfile:
    """The profile of this machine from the measurements: of the GPU measured on (its name and
    memory) when kernels ran on CUDA, else of the CPU (host memory)."""
    device = measured_device()
    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else host_memory_bytes()
    return DeviceProfile(
        name=device_name or measured_device_name(),
        kind=device.type,
        cores=available_cores(),
        memory_bytes=memory,
        backend=backend if backend != "none" else ("nccl" if cuda else "gloo"),
        ranks=max(1, ranks),
        bf16=bf16,
        model=model.name,
        torch=torch.__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        matmul=tuple(tables.matmul),
        grouped_matmul=tuple(tables.grouped_matmul),
        attention=tuple(tables.attention),
        bandwidth=tuple(tables.bandwidth),
        overhead=tuple(tables.overhead),
        collective=tuple(collectives),
        collective_sample=tuple(samples),
    )
