"""`ParallelDims`: the five parallel degrees of a plan, checked against the world size, and the
one `DeviceMesh` they describe.

Mesh axes, rank coordinates and group sizes are `fivefold.specs.geometry`'s (pp outermost, tp
innermost). From the 5-D mesh we derive the flattened groups the runtime needs:

- ``dp``          = dp_replicate x dp_shard: the data-parallel coordinate used to slice the batch;
- ``dp_shard_cp`` = dp_shard x cp: the axis FSDP shards over (CP ranks hold the same weights, so
                    their gradients are reduced together with the sharded data-parallel ones);
- ``dp_cp``       = dp_replicate x dp_shard x cp: every rank holding a replica (or shard) of the
                    same dense weights; DDP (ZeRO-0) all-reduces over it, the loss sums over it;
- ``hsdp``        = dp_cp unflattened to (hsdp_replicate, hsdp_shard) = (dp_replicate,
                    dp_shard x cp): HSDP's 2-D mesh;
- ``expert``      = dp_replicate x dp_shard x cp x tp unflattened to (edp_replicate,
                    edp_shard, ep): ``ep`` is the inner ``ep`` ranks of dp_shard x cp x tp,
                    ``edp_shard`` the outer rest of it and ``edp_replicate`` = dp_replicate
                    (`fivefold.specs.geometry`'s expert rule). Expert weights are split over
                    ``ep`` and data-parallel over edp_replicate x edp_shard; built for a MoE
                    model with ep > 1 or tp > 1 (its tokens are then split over the TP ranks).

Only `build_meshes` touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fivefold.errors import ConfigError
from fivefold.specs.geometry import (
    MESH_ORDER,
    dense_shard_degree,
    ep_fits,
    expert_shard_degree,
    expert_span,
    mesh_shape,
    mesh_size,
    rank_coordinates,
)
from fivefold.specs.plan import ParallelPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES = tuple(axis.value for axis in MESH_ORDER)  # the mesh's dimension names, as torch keeps them


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the five mesh axes plus the expert-parallel degree carved out of dp_shard x cp."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world_size: int) -> ParallelDims:
        """The plan's degrees; `ConfigError` naming the numbers if they do not fit `world_size`."""
        dims = cls(plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp, plan.ep)
        dims.check(world_size)
        return dims

    @property
    def shape(self) -> tuple[int, ...]:
        return mesh_shape(self)

    @property
    def world_size(self) -> int:
        return mesh_size(self)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many slices the global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same dense weights (and reduce their gradients together)."""
        return self.dp * self.cp

    def check(self, world_size: int) -> None:
        problems = []
        for axis, size in zip((*AXES, "ep"), (*self.shape, self.ep), strict=True):
            if not isinstance(size, int) or size < 1:
                problems.append(f"plan.{axis} = {size!r}: must be a whole number >= 1.")
        if problems:
            raise ConfigError(problems)
        if self.world_size != world_size:
            raise ConfigError(
                f"the plan needs pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} x cp {self.cp} x tp {self.tp} = {self.world_size} processes, "
                f"but {world_size} were started; start {self.world_size} processes "
                f"(`fivefold train --nproc {self.world_size}`) or change the plan's degrees so "
                f"they multiply to {world_size}."
            )
        if not ep_fits(self.ep, self.dp_shard, self.cp, self.tp):
            raise ConfigError(
                f"plan.ep = {self.ep} must divide dp_shard * cp * tp = {expert_span(self)}: "
                "expert parallelism borrows its ranks from the sharded data-parallel, context "
                "and tensor axes."
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of `rank` on the five axes (pp outermost, tp innermost)."""
        return rank_coordinates(self, rank)

    def dp_rank(self, rank: int) -> int:
        """Data-parallel index of `rank` (dp_replicate outer, dp_shard inner)."""
        c = rank_coordinates(self, rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        parts = [f"{axis}={size}" for axis, size in zip(AXES, self.shape, strict=True)]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return "mesh " + " x ".join(parts) + f" ({self.world_size} ranks)"

    def build_meshes(self, device_type: str, moe: bool = False) -> Meshes:
        """Create the 5-D mesh and its flattened views (the expert views for a `moe` model);
        collective: every rank must call it."""
        # lazily: ParallelDims checks degrees where torch is not loaded (fivefold.train.entry)
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)
        dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        hsdp = None
        if self.dp_replicate > 1:
            hsdp = dp_cp._unflatten(
                0, (self.dp_replicate, dense_shard_degree(self)), ("hsdp_replicate", "hsdp_shard")
            )
        expert, routing = None, dp_cp
        if self.ep > 1 or (moe and self.tp > 1):
            routing = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
            outer = expert_shard_degree(self)
            expert = routing._unflatten(
                0, (self.dp_replicate, outer, self.ep), ("edp_replicate", "edp_shard", "ep")
            )
        return Meshes(self, world, dp, dp_shard_cp, dp_cp, hsdp, expert, routing)


@dataclass
class Meshes:
    """The world mesh and the views the runtime communicates over (see the module docstring)."""

    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh
    dp_shard_cp: DeviceMesh
    dp_cp: DeviceMesh
    hsdp: DeviceMesh | None  # 2-D (hsdp_replicate, hsdp_shard) when dp_replicate > 1
    expert: DeviceMesh | None  # 3-D (edp_replicate, edp_shard, ep): ep > 1, or MoE with tp > 1
    # the ranks whose MoE layers route different tokens of a step: dp_cp, x tp with the experts
    routing: DeviceMesh | None = None

    def __getitem__(self, axis: str) -> DeviceMesh:
        if axis in AXES:
            return self.world[axis]
        if axis in ("dp", "dp_shard_cp", "dp_cp"):
            return getattr(self, axis)
        if axis in ("ep", "edp_shard", "edp_replicate"):
            if self.expert is None:
                raise KeyError(f"no {axis!r} mesh: plan.ep is 1 (and tp is 1 or the model dense)")
            return self.expert[axis]
        raise KeyError(axis)
