"""Where every rank sits: its mesh coordinates, its node and its TP/PP/DP/CP/EP group.

Ranks are placed as the runtime places them (see `fivefold.spec.plan`): the mesh order, outer to
inner, is pp, dp_replicate, dp_shard, cp, tp, and ranks fill nodes in order, so rank r lives on
node r // gpus_per_node. Expert parallelism borrows its ranks from the dp_shard x cp sub-mesh:
an EP group is `ep` consecutive ranks of that sub-mesh (flattened dp_shard-major).

Group ids are dense integers per axis (0 .. groups-1), numbered by the first rank of each group,
so the page can colour ranks that talk to each other with one colour per group.
"""

from __future__ import annotations

from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.plan import ParallelPlan

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GROUP_AXES = ("tp", "cp", "dp", "pp", "ep")


def rank_coordinates(plan: ParallelPlan) -> list[dict[str, int]]:
    """Mesh coordinates of ranks 0 .. world-1, in rank order (tp varies fastest)."""
    sizes = [getattr(plan, axis) for axis in MESH_AXES]
    coords = []
    for rank in range(plan.world_size):
        rest, point = rank, {}
        for axis, size in zip(reversed(MESH_AXES), reversed(sizes), strict=True):
            point[axis] = rest % size
            rest //= size
        coords.append({axis: point[axis] for axis in MESH_AXES})
    return coords


def _group_key(axis: str, c: dict[str, int], plan: ParallelPlan) -> tuple[int, ...]:
    """The coordinates that stay fixed inside one group of `axis` (members differ only on it)."""
    if axis == "tp":
        return (c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"])
    if axis == "cp":
        return (c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"])
    if axis == "dp":
        return (c["pp"], c["cp"], c["tp"])
    if axis == "pp":
        return (c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"])
    if axis == "ep":
        flat = c["dp_shard"] * plan.cp + c["cp"]
        return (c["pp"], c["dp_replicate"], c["tp"], flat // plan.ep)
    raise ValueError(f"unknown group axis {axis!r}")


def rank_grid(plan: ParallelPlan, cluster: ClusterSpec) -> dict:
    """Per-rank arrays for the page: node, mesh coordinates and group ids.

    Returns {"world_size", "gpus_per_node", "nodes", "node": [int] * world,
    "coords": {axis: [int] * world}, "groups": {axis: [int] * world},
    "group_counts": {axis: int}, "group_sizes": {axis: int}}.
    """
    coords = rank_coordinates(plan)
    groups: dict[str, list[int]] = {}
    for axis in GROUP_AXES:
        ids: dict[tuple[int, ...], int] = {}
        groups[axis] = [ids.setdefault(_group_key(axis, c, plan), len(ids)) for c in coords]
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp, "ep": plan.ep}
    return {
        "world_size": plan.world_size,
        "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes,
        "node": [rank // cluster.gpus_per_node for rank in range(plan.world_size)],
        "coords": {axis: [c[axis] for c in coords] for axis in MESH_AXES},
        "groups": groups,
        "group_counts": {axis: max(groups[axis]) + 1 for axis in GROUP_AXES},
        "group_sizes": sizes,
    }
