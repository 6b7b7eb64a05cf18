"""`fivefold.specs.geometry`: names, mesh coordinates, process groups, shard degrees and chunk
placement, against values worked out by hand."""

from __future__ import annotations

import itertools
import json

import pytest

from fivefold.specs.geometry import (
    CP_KINDS,
    MESH_ORDER,
    OFFLOAD_KINDS,
    RECOMPUTE_POLICIES,
    SCHEDULES,
    V_SHAPED,
    ScheduleName,
    axis_groups,
    chunk_rank,
    chunks_of_rank,
    dense_shard_degree,
    ep_fits,
    expert_shard_degree,
    group_index,
    is_v_shaped,
    mesh_shape,
    mesh_size,
    rank_coordinates,
    rank_tokens,
    sequence_shard_divisor,
)
from fivefold.specs.plan import ParallelPlan


def test_names_are_the_plain_strings_of_the_recipes():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
    assert CP_KINDS == ("ring", "allgather", "ulysses")
    assert RECOMPUTE_POLICIES == ("none", "selective", "full")
    assert OFFLOAD_KINDS == ("none", "optimizer", "all")
    assert all(type(name) is str for name in SCHEDULES)
    assert ScheduleName.ZBV == "zbv" and f"{ScheduleName.ZBV}" == "zbv"
    assert json.dumps({ScheduleName.DUALPIPEV: ScheduleName.ZBV}) == '{"dualpipev": "zbv"}'
    assert [str(axis) for axis in MESH_ORDER] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]


def test_v_shaped_schedules_need_a_pipeline():
    assert V_SHAPED == ("zbv", "dualpipev")
    assert [is_v_shaped(name, 4) for name in SCHEDULES] == [False, False, False, True, True]
    assert not is_v_shaped("zbv", 1)


# pp = 4: the loop deals chunks round-robin, the V folds back at the last rank.
LOOP_PP4_VPP2 = [(0, 4), (1, 5), (2, 6), (3, 7)]
V_PP4 = [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize(
    ("name", "vpp", "expected"),
    [
        ("gpipe", 1, [(0,), (1,), (2,), (3,)]),
        ("1f1b", 1, [(0,), (1,), (2,), (3,)]),
        ("gpipe", 2, LOOP_PP4_VPP2),  # (refused by the plan, but the rule is the loop's)
        ("1f1b", 2, LOOP_PP4_VPP2),
        ("interleaved-1f1b", 2, LOOP_PP4_VPP2),
        ("zbv", 2, V_PP4),
        ("dualpipev", 2, V_PP4),
    ],
)
def test_chunk_placement_at_pp4(name: str, vpp: int, expected: list[tuple[int, ...]]):
    assert [chunks_of_rank(name, 4, vpp, rank) for rank in range(4)] == expected


def test_chunk_rank_inverts_chunks_of_rank():
    assert [chunk_rank("zbv", 4, c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [chunk_rank("interleaved-1f1b", 4, c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert chunks_of_rank("zbv", 1, 2, 0) == (0, 1)  # one rank holds both chunks
    for name, pp in itertools.product(SCHEDULES, (1, 2, 3, 5)):
        vpp = 2 if name in ("interleaved-1f1b", *V_SHAPED) else 1
        held = [chunks_of_rank(name, pp, vpp, r) for r in range(pp)]
        assert sorted(itertools.chain(*held)) == list(range(pp * vpp))
        for r, chunks in enumerate(held):
            assert all(chunk_rank(name, pp, c) == r for c in chunks)


# 16 ranks: pp 2 x dp_shard 2 x cp 2 x tp 2, rank = 8 pp + 4 dp_shard + 2 cp + tp.
MESH = ParallelPlan(pp=2, dp_shard=2, cp=2, tp=2, ep=2, zero=1)


def test_rank_coordinates_are_row_major_with_tp_innermost():
    assert mesh_shape(MESH) == (2, 1, 2, 2, 2) and mesh_size(MESH) == 16
    assert rank_coordinates(MESH, 0) == dict.fromkeys(MESH_ORDER, 0)
    assert rank_coordinates(MESH, 13) == {
        "pp": 1,
        "dp_replicate": 0,
        "dp_shard": 1,
        "cp": 0,
        "tp": 1,
    }
    assert rank_coordinates(MESH, 6) == {
        "pp": 0,
        "dp_replicate": 0,
        "dp_shard": 1,
        "cp": 1,
        "tp": 0,
    }
    with pytest.raises(ValueError, match="rank 16 outside a world of 16"):
        rank_coordinates(MESH, 16)


def test_group_sizes_and_strides():
    assert axis_groups(MESH) == {
        "tp": (2, 1),
        "cp": (2, 2),
        "ep": (2, 1),  # the inner ep ranks of dp_shard x cp x tp: here the TP group
        "dp": (2, 4),
        "dp_shard_cp": (4, 2),
        "dp_cp": (4, 2),
        "dp_cp_tp": (8, 1),
        "dp_replicate": (1, 8),
        "expert_shard": (4, 2),  # dp_shard x cp x tp / ep ranks, ep apart
        "pp": (2, 8),
    }
    # The cp groups, numbered by their first rank: {0,2} {1,3} {4,6} {5,7} ... {13,15} is 7.
    assert [group_index(2, 2, r) for r in (0, 2, 1, 3, 4, 13, 15)] == [0, 0, 1, 1, 2, 7, 7]
    assert [group_index(2, 8, r) for r in (0, 8, 7, 15)] == [0, 0, 7, 7]  # pp: r and r + 8


# The coordinates that stay fixed inside one group of each kind.
FIXED = {
    "tp": ("pp", "dp_replicate", "dp_shard", "cp"),
    "cp": ("pp", "dp_replicate", "dp_shard", "tp"),
    "dp": ("pp", "cp", "tp"),
    "dp_shard_cp": ("pp", "dp_replicate", "tp"),
    "dp_cp": ("pp", "tp"),
    "dp_replicate": ("pp", "dp_shard", "cp", "tp"),
    "dp_cp_tp": ("pp",),
    "pp": ("dp_replicate", "dp_shard", "cp", "tp"),
}


@pytest.mark.parametrize(
    "plan",
    [
        MESH,
        ParallelPlan(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=1, ep=4, zero=3),
        ParallelPlan(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4, zero=3),
    ],
)
def test_groups_are_the_ranks_sharing_the_other_coordinates(plan: ParallelPlan):
    groups = axis_groups(plan)
    coords = [rank_coordinates(plan, r) for r in range(mesh_size(plan))]

    def key(name: str, c: dict[str, int]) -> tuple[int, ...]:
        if name in FIXED:
            return tuple(c[axis] for axis in FIXED[name])
        # ep: the inner ep ranks of dp_shard x cp x tp
        flat = (c["dp_shard"] * plan.cp + c["cp"]) * plan.tp + c["tp"]
        if name == "ep":
            return (c["pp"], c["dp_replicate"], flat // plan.ep)
        return (c["pp"], c["dp_replicate"], flat % plan.ep)  # expert_shard

    for name, (size, stride) in groups.items():
        for a, b in itertools.combinations(range(mesh_size(plan)), 2):
            same = group_index(size, stride, a) == group_index(size, stride, b)
            assert same == (key(name, coords[a]) == key(name, coords[b])), (name, a, b)


def test_shard_degrees_and_the_expert_group():
    plan = ParallelPlan(dp_shard=4, cp=2, ep=4, zero=1)
    assert dense_shard_degree(plan) == 8 and expert_shard_degree(plan) == 2
    assert expert_shard_degree(plan.with_(ep=8)) == 1
    assert ep_fits(4, 4, 2) and ep_fits(8, 4, 2) and not ep_fits(3, 4, 2)
    assert not ep_fits(16, 4, 2)
    # with TP the TP ranks join (each routes its own tokens): ep divides dp_shard x cp x tp
    assert ep_fits(16, 4, 2, 2) and not ep_fits(32, 4, 2, 2)
    assert expert_shard_degree(plan.with_(tp=2)) == 4  # 4 x 2 x 2 / 4
    # Megatron's expert tensor parallelism (etp = tp, published runs of other software): the TP
    # ranks dispatch the same tokens, so EP lives in dp_shard x cp, tp apart
    megatron = plan.with_(tp=2, etp=2)
    assert expert_shard_degree(megatron) == 2
    groups = axis_groups(megatron)
    assert groups["ep"] == (4, 2) and groups["expert_shard"] == (2, 8)
    assert groups["dp_cp_tp"] == groups["dp_cp"] == (8, 2)


def test_a_ranks_token_rows_and_the_sequence_shard():
    """b s/cp rows per micro-batch on a rank; SP splits the norm region tp ways, never tp = 1."""
    plan = ParallelPlan(tp=4, cp=2, sp=True, micro_batch=3)
    assert rank_tokens(3, 8192, plan) == 3 * 8192 / 2
    assert sequence_shard_divisor(True, plan) == 4
    assert sequence_shard_divisor(False, plan) == 1
    assert sequence_shard_divisor(True, ParallelPlan(tp=1, sp=True)) == 1
