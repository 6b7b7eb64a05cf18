"""Where every rank sits: its mesh coordinates, its node and its TP/PP/DP/CP/EP group.

Ranks are placed as the runtime places them (`fivefold.specs.geometry`: pp outermost, tp
innermost), and ranks fill nodes in order, so rank r lives on node r // gpus_per_node. Expert
parallelism borrows its ranks from the dp_shard x cp sub-mesh: an EP group is `ep` consecutive
ranks of that sub-mesh (flattened dp_shard-major).

Group ids are dense integers per axis (0 .. groups-1), numbered by the first rank of each group,
so the page can colour ranks that talk to each other with one colour per group.
"""

from __future__ import annotations

from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import MESH_ORDER, axis_groups, group_index, rank_coordinates
from fivefold.specs.plan import ParallelPlan

GROUP_AXES = ("tp", "cp", "dp", "pp", "ep")


def rank_grid(plan: ParallelPlan, cluster: ClusterSpec) -> dict:
    """Per-rank arrays for the page: node, mesh coordinates and group ids.

    Returns {"world_size", "gpus_per_node", "nodes", "node": [int] * world,
    "coords": {axis: [int] * world}, "groups": {axis: [int] * world},
    "group_counts": {axis: int}, "group_sizes": {axis: int}}.
    """
    ranks = range(plan.world_size)
    coords = [rank_coordinates(plan, rank) for rank in ranks]
    shapes = {axis: axis_groups(plan)[axis] for axis in GROUP_AXES}
    groups = {axis: [group_index(*shapes[axis], rank) for rank in ranks] for axis in GROUP_AXES}
    return {
        "world_size": plan.world_size,
        "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes,
        "node": [rank // cluster.gpus_per_node for rank in ranks],
        "coords": {axis.value: [c[axis] for c in coords] for axis in MESH_ORDER},
        "groups": groups,
        "group_counts": {axis: max(groups[axis]) + 1 for axis in GROUP_AXES},
        "group_sizes": {axis: shapes[axis][0] for axis in GROUP_AXES},
    }
