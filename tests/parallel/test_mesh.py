"""`ParallelDims`: degrees against the world size, rank coordinates, and the real 5-D mesh."""

from __future__ import annotations

import pytest
from harness import run_ranks

from fivefold.errors import ConfigError
from fivefold.parallel.mesh import AXES, ParallelDims
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset


def test_plan_that_does_not_fit_names_the_numbers() -> None:
    plan = ParallelPlan(pp=2, dp_replicate=1, dp_shard=2, zero=3, cp=1, tp=2)
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_plan(plan, world_size=6)
    message = str(err.value)
    for text in ("pp 2", "dp_shard 2", "tp 2", "= 8 processes", "6 were started", "--nproc 8"):
        assert text in message


def test_ep_must_divide_dp_shard_times_cp() -> None:
    with pytest.raises(ConfigError, match=r"plan\.ep = 4 must divide dp_shard \* cp \* tp = 2"):
        ParallelDims(dp_shard=2, ep=4).check(2)


def test_coordinates_are_row_major_with_tp_innermost() -> None:
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert dims.world_size == 8 and dims.dp == 2 and dims.dp_cp == 2
    assert dims.coordinates(0) == dict.fromkeys(AXES, 0)
    assert dims.coordinates(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert dims.coordinates(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_hsdp_dp_rank_puts_replicate_outside_shard() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2)
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_runs_tp_with_moe_refuses_expert_tp_and_pipelines_tied_embeddings() -> None:
    """The runtime's refusals are the plan's validation (one set of rules); tied embeddings
    are pipelined (the first and last stages keep the matrix equal); MoE runs under TP (its
    tokens split over the TP ranks), Megatron's expert tensor parallelism does not."""
    tied = model_preset("tiny").with_(tied_embeddings=True, layers=4)
    ParallelPlan(pp=2).validate(tied)
    ParallelPlan(tp=2, ep=2).validate(model_preset("tiny-moe"))
    with pytest.raises(ConfigError, match=r"set plan\.etp = 1"):
        ParallelPlan(tp=2, etp=2).validate(model_preset("tiny-moe"))
    ParallelPlan(tp=2).validate(tied)  # tied + TP is fine


def _mesh_groups(dims: ParallelDims) -> dict:
    meshes = dims.build_meshes("cpu")
    names = ("pp", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "ep", "edp_shard")
    return {name: meshes[name].mesh.flatten().tolist() for name in names}


def test_mesh_groups_match_coordinates() -> None:
    """On 8 real ranks: every axis and flattened view groups exactly the ranks it should."""
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=2)
    groups = run_ranks(8, _mesh_groups, dims, timeout_s=120)
    for rank, got in enumerate(groups):
        c = dims.coordinates(rank)

        def same(*axes: str, c=c) -> list[int]:
            return [r for r in range(8) if all(dims.coordinates(r)[a] == c[a] for a in axes)]

        assert got["tp"] == [rank]
        assert got["pp"] == same("dp_replicate", "dp_shard", "cp", "tp")
        assert got["cp"] == same("pp", "dp_replicate", "dp_shard", "tp")
        assert got["dp_shard"] == same("pp", "dp_replicate", "cp", "tp")
        assert got["dp"] == got["dp_shard"]
        assert got["dp_shard_cp"] == same("pp", "dp_replicate", "tp")
        assert got["dp_cp"] == same("pp", "tp")
        # ep = the inner 2 of the flattened (dp_shard, cp): the two cp ranks of one dp_shard
        assert got["ep"] == got["cp"]
        assert got["edp_shard"] == got["dp_shard"]
