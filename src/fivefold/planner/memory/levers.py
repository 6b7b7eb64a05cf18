"""Memory levers in bytes: low-precision Adam states (torchao's `AdamW8bit` / `AdamWFp8`), CPU
offload (ZeRO-Offload, FSDP2's `CPUOffloadPolicy`) and the host memory it needs, FP8 all-gather.
Written by hand from the libraries' code (the planner never imports torch); the derivations are
in docs/planner.md, section 4b.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.errors import ConfigError
from fivefold.specs.float8 import fp8_linears
from fivefold.specs.hardware import HOSTS, GPUSpec, HostSpec, host
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import PrecisionRecipe, recipe
from fivefold.units import GiB

TORCHAO_BLOCK = 256  # torchao 0.18 AdamW8bit / AdamWFp8 default block_size
FP32_MOMENTS_BYTES = 8.0  # Adam's m and v in fp32, what the recipes' optimizer bytes include
HOST_RESERVED_FRACTION = 0.2  # of host RAM, never planned for offloaded state


def moment_bytes(states: str) -> float:
    """Bytes per element of one Adam moment (m or v)."""
    if states == "fp32":
        return 4.0
    return 1.0 + 4.0 / TORCHAO_BLOCK  # one byte + an fp32 scale per block


def master_bytes(rec: PrecisionRecipe) -> float:
    """Bytes per parameter of the recipe's master copy: its optimizer bytes less fp32 m and v."""
    return rec.optimizer_bytes - FP32_MOMENTS_BYTES


def state_recipe(plan: ParallelPlan) -> PrecisionRecipe:
    """The plan's precision recipe with Adam's moments in `plan.optimizer_states`."""
    rec = recipe(plan.precision)
    if plan.optimizer_states == "fp32":
        return rec
    assert master_bytes(rec) >= 0, "ParallelPlan.problems refuses compressed-optimizer recipes"
    return replace(
        rec,
        name=f"{rec.name}+{plan.optimizer_states}-states",
        optimizer_bytes=master_bytes(rec) + 2 * moment_bytes(plan.optimizer_states),
    )


def offloads(plan: ParallelPlan, device: GPUSpec) -> bool:
    """Whether the plan moves tenants off the device (a device with a host link)."""
    return plan.offload != "none" and device.pcie_bw_bytes_per_s > 0


def memory_plan(plan: ParallelPlan, device: GPUSpec) -> ParallelPlan:
    """The plan whose memory the device holds: without offload where there is no separate host
    (the CPU holds the "offloaded" state in the same memory)."""
    return plan if plan.offload == "none" or offloads(plan, device) else plan.with_(offload="none")


def split_state(
    params: float, grads: float, optimizer: float, host_params: float, plan: ParallelPlan
) -> tuple[tuple[float, float, float], float]:
    """((params, grads, optimizer) on the device, bytes on the host) of one rank's model state;
    `host_params`: the host copy of the parameters "optimizer" offload keeps for recipes
    without a master copy (see the module docstring)."""
    if plan.offload == "all":
        return (0.0, 0.0, 0.0), params + grads + optimizer
    if plan.offload == "optimizer":
        return (params, grads, 0.0), optimizer + host_params
    return (params, grads, optimizer), 0.0


def resting_param_bytes(rec: PrecisionRecipe) -> float:
    """Bytes per parameter of the sharded weights at rest (FSDP2's fp32 shard is the master
    copy when the recipe has one), what "all" offload copies host-to-device per gather."""
    return 4.0 if master_bytes(rec) > 0 else rec.param_bytes


def fp8_linear_params(model: ModelSpec, moe: bool, fp8: str) -> float:
    """Parameters of one layer in the linears FP8 recipe `fp8` converts to Float8Linear
    (`fivefold.specs.float8.fp8_linears`: attention projections and dense MLP or shared experts
    large enough to gain; never the router, the routed experts or the LM head)."""
    return float(sum(w.params for w in fp8_linears(model, fp8, moe)))


def gathers_fp8(plan: ParallelPlan) -> bool:
    """FSDP2 gathers the converted weights as float8: tensorwise scaling with the weights
    sharded (ZeRO >= 1, `fivefold.parallel.float8.float8_config`)."""
    return plan.fp8 == "tensorwise" and plan.zero >= 1


# ---- host memory -------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostMemory:
    """Offloaded bytes against a node's host RAM."""

    per_gpu_bytes: float  # the worst pipeline rank's offloaded state
    gpus_per_node: int
    node_ram_bytes: float
    system: str

    @property
    def per_node_bytes(self) -> float:
        return self.per_gpu_bytes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.node_ram_bytes * (1 - HOST_RESERVED_FRACTION)

    @property
    def fits(self) -> bool:
        return self.per_node_bytes <= self.usable_bytes

    @property
    def overflow_bytes(self) -> float:
        return max(0.0, self.per_node_bytes - self.usable_bytes)

    def to_json(self) -> dict:
        return {
            "per_gpu_gib": self.per_gpu_bytes / GiB,
            "per_node_gib": self.per_node_bytes / GiB,
            "node_ram_gib": self.node_ram_bytes / GiB,
            "usable_gib": self.usable_bytes / GiB,
            "fits": self.fits,
            "system": self.system,
        }


def node_host(gpu_name: str, device: GPUSpec) -> HostSpec:
    """The catalog host of the node, or a `ConfigError` saying there is none to plan with."""
    spec = host(gpu_name)
    if spec is None or device.pcie_bw_bytes_per_s <= 0:
        raise ConfigError(
            f"plan.offload needs the host of a {gpu_name} node (host RAM, memory bandwidth, "
            "PCIe), which the catalog does not have (fivefold.specs.hardware.HOSTS: "
            f"{', '.join(sorted(HOSTS))}); set plan.offload = 'none' or choose a GPU "
            "whose system is catalogued."
        )
    return spec


def host_memory(
    per_gpu_bytes: float, gpus_per_node: int, gpu_name: str, device: GPUSpec
) -> HostMemory:
    spec = node_host(gpu_name, device)
    return HostMemory(per_gpu_bytes, gpus_per_node, spec.ram_bytes, spec.system)
