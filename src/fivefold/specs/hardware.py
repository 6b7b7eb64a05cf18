"""The accelerator catalog: memory, dense peak FLOP/s per dtype, HBM bandwidth, with sources.

Peaks are *dense* (no 2:4 sparsity) tensor-core figures from the vendor datasheets cited in
`source`. `hbm_bytes` is the nominal capacity (80 GB parts carry 80 GiB of HBM; the H200 the
143,771 MiB nvidia-smi reports; the CUDA context and allocator reserve are separate terms in the
planner). Link figures are the vendor's per-GPU
NVLink bandwidth (both directions added, as marketed) and are only defaults for `ClusterSpec`.
`arch` names the micro-architecture whose calibrated GEMM efficiency the planner uses
(`fivefold.planner.rates.efficiency`). `pcie_bw_bytes_per_s` is the GPU's host link in ONE direction
(a PCIe x16 link's line rate: Gen4 32 GB/s, Gen5 64 GB/s per direction; the datasheets quote
both directions added, 64 / 128 GB/s). `HOSTS` describes the node around the GPU (the DGX
system that carries it): host RAM and the CPUs' theoretical memory bandwidth, for CPU offload
(`planner.memory.levers`); a GPU without a sourced host has none, and offloading on it is an
error that says so. An unknown device is an error that says so, never a guessed
peak: `catalog_key_for_device` maps the name torch gives a GPU to its entry (most specific name
first) and a GPU it does not know runs as `unknown-gpu`, which predicts no time. `nvlink_domain`
is the NVLink fabric of the GPU's system when it spans nodes (GB200 NVL72: 72 GPUs in 18 trays
of 4), the default of `ClusterSpec.nvlink_domain`. A machine measured by `fivefold calibrate`
(a CPU included) is not in the catalog: its `GPUSpec` comes from a device profile
(`profile_device`) and carries the profile as one rank reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from fivefold.errors import ConfigError
from fivefold.specs.profile import RankProfile, load_profile, threads_per_rank
from fivefold.units import GiB

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
    # The device profile as one rank reads it (`fivefold.specs.profile`); None for catalog GPUs.
    rank_profile: RankProfile | None = field(default=None, compare=False, repr=False)
    pcie_bw_bytes_per_s: float = 0.0  # host link, one direction (0: none, e.g. a CPU)
    nvlink_domain: int = 0  # GPUs on one NVLink fabric in its system (GB200 NVL72: 72; 0: a node)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "fp16", "fp8", "tf32", "fp32")."""
        if dtype not in self.peak_flops and self.rank_profile is not None:
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
# GH200: the GPU's host link is NVLink-C2C to its Grace CPU, 900 GB/s both directions added
# (GH200 datasheet), 450 GB/s each way.
GH200_C2C = 450e9
H200_HBM_BYTES = 143_771 * 2**20  # nvidia-smi's total on an H200 SXM (140.4 GiB)
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
            H200_HBM_BYTES,
            _flops(989.4, 1978.9, 494.7, 66.9),
            4.8e12,
            900e9,
            "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column, dense (half of "
            "sparse); memory: the 141 GB of HBM3e as nvidia-smi reports it, 143,771 MiB (measured "
            "2026-11-26 on one H200; torch sees about 139 GiB of it after the driver's share)",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h200-nvl",
            H200_HBM_BYTES,
            _flops(835.5, 1670.5, 417.5, 60),
            4.8e12,
            900e9,
            "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 NVL column, dense (half of "
            "sparse: 1,671 TFLOPS bf16, 3,341 fp8, 835 tf32; fp32 60): 141 GB HBM3e at 4.8 TB/s, "
            "2- or 4-way NVLink bridge 900 GB/s per GPU, PCIe Gen5 128 GB/s, up to 600 W; memory "
            "as the SXM part's nvidia-smi total (the same 141 GB stacks; not measured on an NVL)",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "gh200",
            96 * 10**9,
            _flops(989.4, 1978.9, 494.7, 67),
            4.0e12,
            900e9,
            "NVIDIA GH200 Grace Hopper Superchip datasheet (2023), 96 GB HBM3 configuration "
            "('NVIDIA GH200 480GB': 480 GB LPDDR5X on the Grace): dense (half of sparse: 1,979 "
            "TFLOPS bf16, 3,958 fp8, 989 tf32; fp32 67), HBM3 at 4 TB/s, NVLink 900 GB/s to "
            "other GPUs (NVL32 / NVLink Switch systems), NVLink-C2C 900 GB/s to the Grace CPU",
            "hopper",
            pcie_bw_bytes_per_s=GH200_C2C,
        ),
        GPUSpec(
            "gh200-144gb",
            144 * 10**9,
            _flops(989.4, 1978.9, 494.7, 67),
            4.9e12,
            900e9,
            "NVIDIA GH200 Grace Hopper Superchip datasheet (2024), 144 GB HBM3e configuration: "
            "dense (half of sparse: 1,979 TFLOPS bf16, 3,958 fp8, 989 tf32; fp32 67), HBM3e at "
            "4.9 TB/s, NVLink 900 GB/s to other GPUs, NVLink-C2C 900 GB/s to the Grace CPU",
            "hopper",
            pcie_bw_bytes_per_s=GH200_C2C,
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
            "gb200",
            186 * 10**9,
            _flops(2500, 5000, 1250, 80),
            8.0e12,
            1800e9,
            "NVIDIA GB200 NVL72 datasheet (2024): per rack of 72 GPUs 720 PFLOPS fp8 / 360 PFLOPS "
            "bf16 / 180 PFLOPS tf32 with sparsity (dense: half), 5,760 TFLOPS fp32, 13.4 TB HBM3e "
            "at 576 TB/s, NVLink 5 130 TB/s: per GPU 2.5 PFLOPS bf16 dense, 186 GB, 8 TB/s, "
            "1.8 TB/s; one NVLink domain of 72 GPUs (18 compute trays of 4)",
            "blackwell",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
            nvlink_domain=72,
        ),
        GPUSpec(
            "h100-pcie",
            80 * GiB,
            _flops(756, 1513, 378, 51),
            2.0e12,
            600e9,
            "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 PCIe column, dense (half of "
            "sparse); NVLink bridge 600 GB/s between pairs",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h100-nvl",
            94 * 10**9,
            _flops(835, 1670, 417.5, 60),
            3.9e12,
            600e9,
            "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL column (per GPU), dense "
            "(half of sparse); NVLink bridge 600 GB/s",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "h20",
            96 * 10**9,
            _flops(148, 296, 74, 44),
            4.0e12,
            900e9,
            "NVIDIA HGX H20 specifications as published with its launch (2024; no public "
            "datasheet): 96 GB HBM3 at 4.0 TB/s, 148 TFLOPS bf16 / 296 TFLOPS fp8 dense, 74 "
            "TFLOPS tf32, 44 TFLOPS fp32, NVLink 900 GB/s",
            "hopper",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "l40s",
            48 * 10**9,
            _flops(362.05, 733, 183, 91.6),
            864e9,
            0.0,
            "NVIDIA L40S datasheet (2023), dense (half of sparse): 48 GB GDDR6 at 864 GB/s, no "
            "NVLink (GPUs talk over PCIe Gen4 x16)",
            "ada",
            pcie_bw_bytes_per_s=PCIE_GEN4_X16,
        ),
        GPUSpec(
            "mi300x",
            192 * 10**9,
            _flops(1307.4, 2614.9, 653.7, 163.4),
            5.3e12,
            896e9,
            "AMD Instinct MI300X data sheet (2023): 192 GB HBM3 at 5.3 TB/s, peak dense matrix "
            "1,307.4 TFLOPS bf16, 2,614.9 fp8, 653.7 tf32, 163.4 fp32; 7 Infinity Fabric links, "
            "896 GB/s aggregate peer bandwidth",
            "cdna3",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "mi325x",
            256 * 10**9,
            _flops(1307.4, 2614.9, 653.7, 163.4),
            6.0e12,
            896e9,
            "AMD Instinct MI325X data sheet (2024): 256 GB HBM3E at 6 TB/s, peak dense matrix "
            "1,307.4 TFLOPS bf16, 2,614.9 fp8, 653.7 tf32, 163.4 fp32 (the MI300X's compute); "
            "896 GB/s aggregate Infinity Fabric",
            "cdna3",
            pcie_bw_bytes_per_s=PCIE_GEN5_X16,
        ),
        GPUSpec(
            "cpu",
            0,
            {},
            0.0,
            0.0,
            "no catalog peak: `fivefold calibrate` measures this machine into a device profile "
            "(fivefold.specs.profile); without one, training on CPU measures a matmul peak at "
            "start-up and labels MFU as relative to that measurement",
        ),
        GPUSpec(
            "unknown-gpu",
            0,
            {},
            0.0,
            0.0,
            "a GPU not in the catalog: no peak, memory or link figure is assumed for it; name a "
            "catalogued GPU in [cluster] (gpu = ...) or measure it with `fivefold calibrate`",
        ),
    )
}
UNKNOWN_GPU = "unknown-gpu"
GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm"}

# Device names as `torch.cuda.get_device_name` reports them -> catalog key, most specific first:
# GB200 before B200, GH200 ('NVIDIA GH200 480GB') and the H200 NVL card before the H200 SXM,
# H200 before H20, the H100 NVL and PCIe cards before the SXM part ('NVIDIA H100 80GB HBM3').
# "a100" and "gh200" are split by memory.
_DEVICE_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), key)
    for pattern, key in (
        (r"\bgb200\b", "gb200"),
        (r"\bb200\b", "b200"),
        (r"\bgh200\b", "gh200"),
        (r"\bh200\b.*\bnvl\b", "h200-nvl"),
        (r"\bh200\b", "h200"),
        (r"\bh20\b", "h20"),
        (r"\bh100\b.*\bnvl\b", "h100-nvl"),
        (r"\bh100\b.*\bpcie\b", "h100-pcie"),
        (r"\bh100\b.*\bhbm2e\b", "h100-96gb-hbm2e"),
        (r"\bh100\b", "h100-sxm"),
        (r"\bh800\b(?!.*\b(pcie|nvl)\b)", "h800"),
        (r"\ba100\b", "a100"),
        (r"\bl40s\b", "l40s"),
        (r"\bmi325x\b", "mi325x"),
        (r"\bmi300x\b", "mi300x"),
    )
)
_A100_80GB_MIN_BYTES = 60 * GiB  # between the 40 GB and 80 GB parts
_GH200_144GB_MIN_BYTES = 120 * GiB  # between the 96 GB and 144 GB parts


def catalog_key_for_device(name: str, total_memory_bytes: int | None = None) -> str | None:
    """The catalog key of a device named as torch names it ('NVIDIA H100 80GB HBM3' ->
    'h100-sxm'), or None for a device the catalog does not hold. An A100 is told apart by its
    memory (`total_memory_bytes`, else the '40GB' / '80GB' in its name)."""
    lower = name.lower()
    for pattern, key in _DEVICE_NAMES:
        if not pattern.search(lower):
            continue
        if key == "gh200":
            return _gh200_key(lower, total_memory_bytes)
        if key != "a100":
            return key
        if total_memory_bytes:
            return "a100-80gb" if total_memory_bytes > _A100_80GB_MIN_BYTES else "a100-40gb"
        return next((f"a100-{size}" for size in ("80gb", "40gb") if size in lower), None)
    return None


def _gh200_key(lower: str, total_memory_bytes: int | None) -> str:
    """The GH200 of 96 GB HBM3 or of 144 GB HBM3e, by memory or else by name."""
    if total_memory_bytes:
        return "gh200-144gb" if total_memory_bytes > _GH200_144GB_MIN_BYTES else "gh200"
    return "gh200-144gb" if "hbm3e" in lower or "144g" in lower else "gh200"


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
_GH200_HOST = HostSpec(
    "GH200 superchip",
    480 * 10**9,
    512e9,
    "NVIDIA GH200 Grace Hopper Superchip datasheet (2023): one Grace CPU per GPU with up to "
    "480 GB LPDDR5X at up to 512 GB/s",
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
    "gh200": _GH200_HOST,
    "gh200-144gb": _GH200_HOST,
    "gb200": HostSpec(
        "GB200 NVL72 compute tray",
        2 * 480 * 10**9,
        2 * 512e9,
        "NVIDIA GB200 NVL72 datasheet (2024): 36 Grace CPUs with up to 17 TB LPDDR5X at up to "
        "18.4 TB/s per rack, i.e. 480 GB at 512 GB/s per Grace; a tray holds 2 Graces, 4 GPUs",
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


def measured_gpu(rank: RankProfile) -> GPUSpec:
    """The `GPUSpec` of a device profile for one rank: peaks the best measured matmul rate per
    dtype, memory the rank's (a GPU's HBM is its own; host memory is shared by the ranks)."""
    prof = rank.profile
    peaks = {dt: rank.peak(dt) for dt in sorted({m.dtype for m in prof.matmul})}
    src = prof.path or "a device profile"
    per_rank = prof.memory_bytes if prof.kind == "cuda" else prof.memory_bytes // rank.ranks
    return GPUSpec(
        name=prof.name,
        hbm_bytes=per_rank,
        peak_flops=peaks,
        hbm_bw_bytes_per_s=rank.bandwidth("elementwise_forward"),
        nvlink_bw_bytes_per_s=0.0,
        source=f"measured by `fivefold calibrate` ({src}): best matmul rate per dtype at "
        f"{rank.threads} thread(s) per rank, {rank.ranks} rank(s) on {prof.cores} core(s)",
        rank_profile=rank,
    )


@lru_cache(maxsize=64)
def _cached_device(path: str, mtime_ns: int, ranks: int, threads: int) -> GPUSpec:
    return measured_gpu(RankProfile.of(load_profile(path), ranks, threads))


def profile_device(path: str | Path, ranks: int = 1) -> GPUSpec:
    """The measured device of the profile at `path` for one of `ranks` processes (cached)."""
    p = Path(path).expanduser()
    mtime = p.stat().st_mtime_ns if p.is_file() else 0
    cores = load_profile(p).cores
    return _cached_device(str(p), mtime, max(1, ranks), threads_per_rank(ranks, cores))
