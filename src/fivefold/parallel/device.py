"""Where a run executes, found rather than told: the one resolution of `train.device`
("auto" | "cpu" | "cuda": `uses_cuda`, `pick_device`), the GPU this process uses (`local_gpu`)
and the `[cluster]` a GPU run without one gets (`local_cluster_table`). Native bf16 only: a V100
or T4 emulates bf16 slowly, so a run there defaults to fp32 as on a CPU.
"""

from __future__ import annotations

import inspect
import os
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fivefold.errors import ConfigError
from fivefold.specs.cluster import cluster_for_gpu
from fivefold.specs.hardware import UNKNOWN_GPU, catalog_key_for_device
from fivefold.units import GiB, MiB

# torch is imported inside the functions that use it: the recipe checks read DEVICE_SETTINGS and
# `fivefold --help` imports this module without torch.
if TYPE_CHECKING:
    import torch

DEVICE_SETTINGS = ("auto", "cpu", "cuda")
BF16_MIN_CAPABILITY = (8, 0)  # Ampere and newer run bf16 on their tensor cores


def uses_cuda(setting: str) -> bool:
    """Whether `train.device = setting` runs on CUDA on this machine (no side effects)."""
    if setting == "cpu":
        return False
    import torch

    available = torch.cuda.is_available()
    if setting == "cuda" and not available:
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto'.")
    return available if setting in DEVICE_SETTINGS else False


def pick_device(setting: str, rank: int | None = None) -> torch.device:
    """`train.device = setting` as a torch device: cuda:RANK (made the current device; RANK is
    `rank`, else LOCAL_RANK) when `uses_cuda`, else cpu."""
    import torch

    if not uses_cuda(setting):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank() if rank is None else rank)
    torch.cuda.set_device(device)
    return device


def device_setting_for(processes: int) -> str:
    """ "auto" when this machine has a GPU for each of `processes` local processes, else "cpu"
    (spawned helpers such as `fivefold calibrate`'s ranks, which run wherever they fit)."""
    import torch

    return "auto" if torch.cuda.device_count() >= processes else "cpu"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size(world: int) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else all of `world` (a launcher
    checking the processes it is about to start on this machine)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def real_bf16() -> bool:
    """Whether the current CUDA device computes bf16 natively (not emulated, as a V100 or T4
    does): `is_bf16_supported(including_emulation=False)`, else compute capability >= 8.0."""
    import torch

    check = torch.cuda.is_bf16_supported
    if "including_emulation" in inspect.signature(check).parameters:
        return bool(check(including_emulation=False))
    return tuple(torch.cuda.get_device_capability()) >= BF16_MIN_CAPABILITY


@dataclass(frozen=True)
class LocalGPU:
    """The GPU this process uses, as torch reports it."""

    name: str  # torch.cuda.get_device_name, e.g. "NVIDIA H200"
    total_memory_bytes: int
    catalog_key: str | None  # None: not in the catalog
    bf16: bool  # native bf16

    def describe(self) -> str:
        known = self.catalog_key or "not in the catalog"
        return f"{self.name} ({known}, {self.total_memory_bytes / GiB:.1f} GiB)"


def local_gpu(index: int | None = None) -> LocalGPU | None:
    """This process's GPU (`LOCAL_RANK` unless `index`), or None without CUDA.

    A process that has not touched CUDA and is no torchrun worker (a launcher checking the
    run before starting its ranks) asks `nvidia-smi` first: torch would create a CUDA context
    on GPU 0 that the launcher then holds, several hundred MiB, for the whole run."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = local_rank() if index is None else index
    if not torch.cuda.is_initialized() and "LOCAL_RANK" not in os.environ:
        found = _nvidia_smi_gpu(index)
        if found is not None:
            return found
    index = index if index < torch.cuda.device_count() else 0
    name = torch.cuda.get_device_name(index)
    memory = int(torch.cuda.get_device_properties(index).total_memory)
    return LocalGPU(name, memory, catalog_key_for_device(name, memory), real_bf16())


def _nvidia_smi_gpu(index: int) -> LocalGPU | None:
    """GPU `index` (as CUDA numbers the visible ones) read by nvidia-smi, which creates no CUDA
    context; None where nvidia-smi is absent or says nothing usable (e.g. a ROCm machine)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    which = visible[index] if index < len(visible) and visible[index] else str(index)
    query = "--query-gpu=name,memory.total,compute_cap"
    command = ["nvidia-smi", f"--id={which}", query, "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        name, mib, capability = (
            x.strip() for x in out.stdout.strip().splitlines()[0].rsplit(",", 2)
        )
        memory = int(float(mib)) * MiB
        native_bf16 = tuple(int(x) for x in capability.split(".")) >= BF16_MIN_CAPABILITY
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return LocalGPU(name, memory, catalog_key_for_device(name, memory), native_bf16)


def local_cluster_table(world: int, local_world: int | None = None) -> dict[str, Any]:
    """The `[cluster]` table of `world` processes on this machine's GPU, `local_world` per node
    (default: `local_world_size(world)`); ConfigError without CUDA."""
    gpu = local_gpu()
    if gpu is None:
        raise ConfigError("no CUDA device is available to describe; use train.device = 'cpu'.")
    per_node = local_world or local_world_size(world)
    if per_node < 1 or world % per_node:
        per_node = world  # uneven nodes are torchrun's to refuse; plan for one
    cluster = cluster_for_gpu(gpu.catalog_key or UNKNOWN_GPU, world, per_node, gpu.name)
    table = cluster.to_dict()
    table.pop("profile")
    return table


def unknown_gpu_reason(cluster: Any) -> str | None:
    """Why no step time is predicted on `cluster`'s GPU when the catalog does not know it."""
    if cluster.gpu != UNKNOWN_GPU or cluster.profile:
        return None
    return (
        f"no step-time prediction: {cluster.name} is not in the GPU catalog, so its peak is "
        "unknown (name a catalogued GPU in [cluster] gpu = ..., or measure this machine with "
        "`fivefold calibrate`)"
    )
