"""`ClusterSpec`: the machines a plan runs on, and the link hierarchy between its GPUs.

Bandwidths are bytes/s per GPU as the vendor quotes them; latencies in seconds. Ranks are placed
node-major: ranks [k*gpus_per_node, (k+1)*gpus_per_node) share node k and its NVLink domain.

- `intra_node_bw` is the marketed NVLink figure per GPU, both directions added (A100 600 GB/s =
  12 NVLink3 links x 25 GB/s x 2 directions); a ring collective moves data one way, so the planner
  uses half of it (`fivefold.planner.step_time.comm`).
- `inter_node_bw` is the line rate of the GPU's own NIC in one direction (DGX A100: one HDR
  200 Gb/s NIC per GPU = 25 GB/s; DGX H100: one NDR 400 Gb/s NIC per GPU = 50 GB/s).
- Latencies are the per-message start-up cost (alpha) of one hop: about 1 us over NVLink and
  5 us over InfiniBand (NCCL's small-message latencies; order of magnitude only).
- `profile` names a device profile measured by `fivefold calibrate` (`fivefold.specs.profile`):
  the device is then the measured machine, one node whose `gpus_per_node` are its local ranks,
  and the planner times kernels and collectives from the measurements.
- `nvlink_domain` is the number of GPUs one NVLink fabric joins when it spans nodes (GB200 NVL72:
  72 GPUs in trays of 4); 0 means one node. A group inside one domain uses NVLink
  (`fivefold.planner.step_time.comm`), and tensor parallelism may span the domain (`nvlink_gpus`).
Presets exist for any GPU count: up to one node it is a single partial node, beyond that the
count must fill whole nodes (8 GPUs; 4 for GB200 NVL72).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fivefold.errors import ConfigError
from fivefold.specs.hardware import GPUS, GPUSpec, gpu, profile_device
from fivefold.specs.profile import load_profile

MAX_GPUS = 1 << 17  # 131,072: beyond the largest clusters built; bounds every search


@dataclass(frozen=True)
class ClusterSpec:
    name: str = "dgx-h100"
    gpu: str = "h100-sxm"
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node_bw: float = 900e9  # bytes/s per GPU (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per GPU (InfiniBand: one 400 Gb/s NIC per GPU)
    intra_node_latency_s: float = 1e-6
    inter_node_latency_s: float = 5e-6
    profile: str = ""  # a device profile (`fivefold calibrate`): its device replaces `gpu`
    nvlink_domain: int = 0  # GPUs sharing one NVLink fabric, a multiple of gpus_per_node; 0: a node

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nvlink_gpus(self) -> int:
        """GPUs one NVLink domain holds in this cluster: `nvlink_domain` (one node when 0), at
        most the whole cluster. TP and the groups inside it stay on NVLink."""
        return min(self.nvlink_domain or self.gpus_per_node, self.world_size)

    @property
    def device(self) -> GPUSpec:
        """The catalog GPU, or the measured device of `profile` for one of the node's ranks."""
        if self.profile:
            return profile_device(self.profile, self.gpus_per_node)
        return gpu(self.gpu)

    def with_(self, **changes) -> ClusterSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def problems(self) -> list[str]:
        out = []
        for f in ("nodes", "gpus_per_node"):
            if getattr(self, f) < 1:
                out.append(f"cluster.{f} = {getattr(self, f)}: must be at least 1.")
        if self.world_size > MAX_GPUS:
            out.append(
                f"cluster of {self.world_size:,} GPUs ({self.nodes:,} nodes x "
                f"{self.gpus_per_node:,}): fivefold plans at most {MAX_GPUS:,} GPUs; check "
                "--gpus / cluster.gpus."
            )
        domain = self.nvlink_domain
        if domain and (domain < self.gpus_per_node or domain % max(1, self.gpus_per_node)):
            out.append(
                f"cluster.nvlink_domain = {domain}: an NVLink domain holds whole nodes; give a "
                f"multiple of cluster.gpus_per_node = {self.gpus_per_node} (or 0 for one node)."
            )
        for f in ("intra_node_bw", "inter_node_bw"):
            if getattr(self, f) <= 0:
                out.append(f"cluster.{f} = {getattr(self, f)}: must be a positive bytes/s figure.")
        for f in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, f) < 0:
                out.append(f"cluster.{f} = {getattr(self, f)}: must be >= 0 seconds.")
        try:
            self.device  # noqa: B018 (a catalog GPU, or a readable, valid profile)
        except ConfigError as err:
            out.append(str(err))
        if self.profile and self.nodes != 1:
            out.append(
                f"cluster.nodes = {self.nodes}: a device profile describes one machine; "
                "set nodes = 1 and the local ranks as gpus (or gpus_per_node)."
            )
        return out


def node_split(
    gpus: int, per_node: int, field: str = "--gpus", nodes: str = "nodes", per_node_field: str = ""
) -> tuple[int, int]:
    """(nodes, GPUs per node) of `gpus` GPUs in nodes of `per_node`: one node of `gpus` when they
    fit in one, else whole nodes; a ConfigError naming `field` (and `per_node_field`, where the
    user set the node size) when they do not fill whole nodes (`nodes`: what the message calls
    them, e.g. "dgx-h100 nodes")."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        lower = gpus // per_node * per_node
        size = f" ({per_node_field})" if per_node_field else ""
        raise ConfigError(
            f"{field} = {gpus} does not fill whole {nodes} of {per_node} GPUs{size}; use a "
            f"multiple of {per_node} (e.g. {lower} or {lower + per_node}) or at most {per_node}."
        )
    return gpus // per_node, per_node


def _dgx(name: str, gpu_name: str, nvlink: float, ib: float, per_node: int = 8, domain: int = 0):
    def make(gpus: int = per_node, **overrides) -> ClusterSpec:
        if not isinstance(gpus, int) or gpus < 1:
            raise ConfigError(f"--gpus = {gpus!r}: must be a whole number >= 1.")
        nodes, local = node_split(gpus, per_node, nodes=f"{name} nodes")
        overrides.setdefault("nvlink_domain", domain)
        return ClusterSpec(name, gpu_name, nodes, local, nvlink, ib, **overrides)

    return make


CLUSTER_PRESETS = {
    # DGX A100: NVLink3 600 GB/s per GPU; 8x HDR 200 Gb/s = 25 GB/s per GPU.
    "dgx-a100": _dgx("dgx-a100", "a100-80gb", 600e9, 25e9),
    # DGX H100: NVLink4 900 GB/s per GPU; 8x NDR 400 Gb/s = 50 GB/s per GPU.
    "dgx-h100": _dgx("dgx-h100", "h100-sxm", 900e9, 50e9),
    "dgx-h200": _dgx("dgx-h200", "h200", 900e9, 50e9),
    "hgx-h800": _dgx("hgx-h800", "h800", 400e9, 50e9),
    "dgx-b200": _dgx("dgx-b200", "b200", 1800e9, 50e9),
    # GB200 NVL72: trays of 4 GPUs, one NVLink 5 domain of 72 (1.8 TB/s per GPU); one
    # ConnectX-7 400 Gb/s NIC per GPU beyond the rack.
    "gb200-nvl72": _dgx("gb200-nvl72", "gb200", 1800e9, 50e9, per_node=4, domain=72),
    "hgx-h20": _dgx("hgx-h20", "h20", 900e9, 50e9),
    # AMD Instinct platforms: 8 GPUs fully connected by Infinity Fabric (896 GB/s aggregate per
    # GPU), one 400 Gb/s NIC per GPU.
    "amd-mi300x": _dgx("amd-mi300x", "mi300x", 896e9, 50e9),
    "amd-mi325x": _dgx("amd-mi325x", "mi325x", 896e9, 50e9),
}


def cluster_for_gpu(gpu_name: str, gpus: int, per_node: int, name: str = "") -> ClusterSpec:
    """`gpus` of catalog GPU `gpu_name` in nodes of `per_node` (a run on the GPUs it found):
    links from the GPU's own system (its preset: NVLink and NIC per GPU, NVLink domain), else
    its NVLink figure (PCIe both ways for a card without NVLink) and the default NIC."""
    base = next((make() for make in CLUSTER_PRESETS.values() if make().gpu == gpu_name), None)
    if base is None:
        device = GPUS[gpu_name]
        link = device.nvlink_bw_bytes_per_s or 2 * device.pcie_bw_bytes_per_s
        base = ClusterSpec(gpu=gpu_name, intra_node_bw=link or ClusterSpec.intra_node_bw)
    domain = base.nvlink_domain if base.nvlink_domain % per_node == 0 else 0
    return base.with_(
        name=name or base.name,
        nodes=max(1, gpus // per_node),
        gpus_per_node=per_node,
        nvlink_domain=domain,
    )


def cluster_preset(name: str, gpus: int = 8) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise ConfigError(
            f"cluster = {name!r} is not a preset; choose one of {', '.join(CLUSTER_PRESETS)} "
            "or describe it with --gpu, --gpus-per-node, --nvlink-gbps and --ib-gbps."
        )
    return CLUSTER_PRESETS[name](gpus)


def profile_cluster(path: str | Path, ranks: int | None = None, **overrides) -> ClusterSpec:
    """The `ClusterSpec` of a device profile: one node of `ranks` local processes (default: the
    ranks its collectives were measured on)."""
    prof = load_profile(path)
    values = {
        "name": f"profile:{Path(path).name}",
        "gpu": prof.name,
        "nodes": 1,
        "gpus_per_node": ranks or prof.ranks,
        "profile": str(path),
        **overrides,
    }
    return ClusterSpec(**values)


def require_hbm(cluster: ClusterSpec) -> None:
    """Raise unless the cluster's GPU has the HBM capacity and bandwidth a plan is priced with."""
    if cluster.device.hbm_bytes <= 0 or cluster.device.hbm_bw_bytes_per_s <= 0:
        raise ConfigError(
            f"cluster.gpu = {cluster.gpu!r} has no HBM capacity or bandwidth in the catalog, so "
            "nothing can be planned for it; choose a datacenter GPU such as h100-sxm."
        )
