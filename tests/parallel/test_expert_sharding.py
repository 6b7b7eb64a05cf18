"""ZeRO-3 over experts that EP already split to fewer per rank than the sharding ranks: every
rank holds an equal share of each expert (FSDP splits the expert's width), checked on the real
runtime in a fake world of 16 ranks (`fivefold.train.plan_check.fake_world`)."""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fivefold.specs.recipe import recipe_from_dict
from fivefold.train.plan_check import _CheckedRuntime, fake_world

MODEL = {"preset": "tiny-moe", "layers": 2, "experts": 8, "top_k": 2, "expert_ffn": 64}


def local_expert_elements(rank: int) -> int:
    recipe = recipe_from_dict(
        {
            "model": MODEL,
            "cluster": {"gpu": "h100-sxm", "gpus": 16},
            "plan": {"dp_shard": 16, "ep": 8, "zero": 3, "precision": "fp32"},
        }
    )
    fake = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with fake_world(recipe, rank, 16), fake:
        runtime = _CheckedRuntime(recipe)
        experts = [p for n, p in runtime.model_parts[0].named_parameters() if ".experts." in n]
        assert all(isinstance(p, DTensor) for p in experts)
        return sum(p.to_local().numel() for p in experts)


def test_each_rank_holds_an_equal_share_of_the_experts() -> None:
    # 2 layers x 8 experts x 3 matrices of 64 x 64, over 16 ranks (EP8 x ZeRO-3 over 2)
    share = 2 * 8 * 3 * 64 * 64 // 16
    assert [local_expert_elements(rank) for rank in (0, 8)] == [share, share]
