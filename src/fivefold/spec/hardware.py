"""The accelerator catalog: memory, dense peak FLOP/s per dtype, HBM bandwidth, with sources.

Peaks are *dense* (no 2:4 sparsity) tensor-core figures from the vendor datasheets cited in
`source`. `hbm_bytes` is the nominal capacity (80 GB parts carry 80 GiB of HBM; the CUDA context
and allocator reserve are separate terms in the planner). Link figures are the vendor's per-GPU
NVLink bandwidth (both directions added, as marketed) and are only defaults for `ClusterSpec`.
`arch` names the micro-architecture whose calibrated GEMM efficiency the planner uses
(`fivefold.planner.calibration`). `pcie_bw_bytes_per_s` is the GPU's host link in ONE direction
(a PCIe x16 link's line rate: Gen4 32 GB/s, Gen5 64 GB/s per direction; the datasheets quote
both directions added, 64 / 128 GB/s). `HOSTS` describes the node around the GPU (the DGX
system that carries it): host RAM and the CPUs' theoretical memory bandwidth, for CPU offload
(`fivefold.planner.levers`); a GPU without a sourced host has none, and offloading on it is an
error that says so. An unknown device is an error that says so, never a guessed
peak. A machine measured by `fivefold calibrate` (a CPU included) is not in the catalog: its
`GPUSpec` comes from a device profile (`fivefold.spec.profile`) and carries the measured tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fivefold.spec.profile import Measured

from fivefold.errors import ConfigError

GiB = 2**30
TERA = 1e12


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_bytes: int
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    hbm_bw_bytes_per_s: float
    nvlink_bw_bytes_per_s: float
    source: str = field(compare=False, default="")
    arch: str = ""  # "ampere" | "hopper" | "blackwell" | "" (no accelerator)
    # The measured tables of a device profile (`fivefold.spec.profile`); None for catalog GPUs.
    measured: Measured | None = field(default=None, compare=False, repr=False)
    pcie_bw_bytes_per_s: float = 0.0  # host link, one direction (0: none, e.g. a CPU)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "fp16", "fp8", "tf32", "fp32")."""
        if dtype not in self.peak_flops and self.measured is not None:
            known = ", ".join(sorted(self.peak_flops))
            raise ConfigError(
                f"unknown peak: the device profile of {self.name} has no {dtype} matmul "
                f"measurement (measured: {known}); choose a {known} precision or re-run "
                "`fivefold calibrate` on a machine with native support for it."
            )
        if dtype not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops)) or "none: it is not a catalogued GPU"
            raise ConfigError(
                f"unknown peak: {self.name} has no published dense {dtype} peak in the catalog "
                f"(known: {known})."
            )
        return self.peak_flops[dtype]


def _flops(bf16: float, fp8: float | None, tf32: float, fp32: float) -> dict[str, float]:
    out = {"bf16": bf16 * TERA, "fp16": bf16 * TERA, "tf32": tf32 * TERA, "fp32": fp32 * TERA}
    if fp8 is not None:
        out["fp8"] = fp8 * TERA
    return out


# PCIe x16 line rate per direction: Gen4 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s, Gen5 twice
# that (PCI-SIG); the A100 datasheet quotes "PCIe Gen4: 64 GB/s", the H100/H200/H800 and B200
# ones "PCIe Gen5: 128 GB/s", both directions added.
PCIE_GEN4_X16 = 31.5e9
PCIE_GEN5_X16 = 63.0e9
_A100_SRC = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column, dense figures"
_H100_SRC = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column, dense (half of sparse)"
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(
            "a100-40gb",
            40 * GiB,
            _flops(312, None, 156, 19.5),
            1.555e12,
            600e9,
            _A100_SRC,
            "ampere",
            pcie_bw_bytes_per_s=PCIE_GEN4_X16,
        ),
        GPUSpec(
            "a100-80gb",
            80 * GiB,
            _flops(312, None, 156, 19.5),
            2.039e12,
            600e9,
            _A100_SRC,
            "ampere",
            pcie_bw_bytes_per_s=PCIE_GEN4_X16,
        ),
        GPUSpec(
            "h100-sxm",
            80 * GiB,
            _flops(989.4, 1978.9, 494.7, 66.9),
            3.35e12,
            900e9,
            _H100_SRC,
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h100-96gb-hbm2e",
            96 * GiB,
            _flops(989.4, 1978.9, 494.7, 66.9),
            2.4e12,
            900e9,
            "torchtitan benchmarks (2024-12), Grand Teton platform: H100 with 96 GB HBM2e at "
            "2.4 TB/s peak memory bandwidth, 8 per host fully connected by NVLink, default 500 W "
            "power limit (not modelled); dense peak as the SXM part, the one torchtitan's MFU uses",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h200",
            141 * 10**9,
            _flops(989.4, 1978.9, 494.7, 66.9),
            4.8e12,
            900e9,
            "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column, dense",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h800",
            80 * GiB,
            _flops(989.4, 1978.9, 494.7, 66.9),
            3.35e12,
            400e9,
            "NVIDIA H800 SXM5 product brief (2023): H100 compute, NVLink limited to 400 GB/s",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "b200",
            180 * 10**9,
            _flops(2250, 4500, 1100, 75),
            7.7e12,
            1800e9,
            "NVIDIA DGX B200 datasheet (2024): 72 PFLOPS fp8 / 36 PFLOPS bf16 dense per 8 GPUs, "
            "1,440 GB HBM3e per 8 GPUs, NVLink 5 1.8 TB/s",
            "blackwell",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "cpu",
            0,
            {},
            0.0,
            0.0,
            "no catalog peak: `fivefold calibrate` measures this machine into a device profile "
            "(fivefold.spec.profile); without one, training on CPU measures a matmul peak at "
            "start-up and labels MFU as relative to that measurement",
        ),
    )
}
GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm"}


def gpu(name: str) -> GPUSpec:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ConfigError(
            f"cluster.gpu = {name!r} is not in the catalog; choose one of "
            f"{', '.join(sorted(GPUS))} (or an alias: {', '.join(sorted(GPU_ALIASES))})."
        )
    return GPUS[key]


@dataclass(frozen=True)
class HostSpec:
    """The host of one node: RAM and the CPUs' theoretical memory bandwidth (all sockets)."""

    system: str
    ram_bytes: float
    mem_bw_bytes_per_s: float
    source: str = field(compare=False, default="")


_DDR4_3200_X8 = 8 * 25.6e9  # one socket, 8 channels of DDR4-3200: 204.8 GB/s
_DDR5_4800_X8 = 8 * 38.4e9  # 307.2 GB/s
_DDR5_5600_X8 = 8 * 44.8e9  # 358.4 GB/s
TB = 10**12
_DGX_H100_HOST = HostSpec(
    "DGX H100",
    2 * TB,
    2 * _DDR5_4800_X8,
    "NVIDIA DGX H100 datasheet (2023): 2 TB system memory, 2x Intel Xeon Platinum 8480C; "
    "Intel: 8 DDR5-4800 channels per socket (38.4 GB/s each)",
)
# Keyed by catalog GPU: the DGX system that carries it (defaults, like the NVLink figures).
HOSTS: dict[str, HostSpec] = {
    "a100-40gb": HostSpec(
        "DGX A100 320GB",
        1 * TB,
        2 * _DDR4_3200_X8,
        "NVIDIA DGX A100 datasheet (2020): 1 TB system memory (320 GB model), 2x AMD EPYC "
        "7742; AMD: 8 DDR4-3200 channels per socket (25.6 GB/s each)",
    ),
    "a100-80gb": HostSpec(
        "DGX A100 640GB",
        2 * TB,
        2 * _DDR4_3200_X8,
        "NVIDIA DGX A100 datasheet (2020): 2 TB system memory (640 GB model), 2x AMD EPYC "
        "7742; AMD: 8 DDR4-3200 channels per socket (25.6 GB/s each)",
    ),
    "h100-sxm": _DGX_H100_HOST,
    "h200": HostSpec(
        "DGX H200",
        2 * TB,
        2 * _DDR5_4800_X8,
        "NVIDIA DGX H200 datasheet (2024): 2 TB system memory, 2x Intel Xeon Platinum 8480C",
    ),
    "b200": HostSpec(
        "DGX B200",
        2 * TB,
        2 * _DDR5_5600_X8,
        "NVIDIA DGX B200 datasheet (2024): 2 TB system memory (up to 4 TB), 2x Intel Xeon "
        "Platinum 8570; Intel: 8 DDR5-5600 channels per socket (44.8 GB/s each)",
    ),
}


def host(gpu_name: str) -> HostSpec | None:
    """The catalog host of nodes carrying `gpu_name` (None where no sourced figure exists)."""
    key = GPU_ALIASES.get(gpu_name.lower(), gpu_name.lower())
    return HOSTS.get(key)
