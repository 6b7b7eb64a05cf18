"""One set of rules: what the runtime refuses is what `ParallelPlan.problems` refuses.

- every layout the search proposes (any model: dense, MoE, tied; several cluster sizes) passes
  the validation, and every candidate it calls invalid is refused by it;
- the runtime (`DistributedRuntime`, `LocalRuntime`) refuses exactly those, with the same
  message, before it touches a process group;
- every recipe in configs/ loads and validates;
- `fivefold plan` builds its model through the recipe code: flags and TOML give one ModelSpec.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.search.layouts import search
from fivefold.specs import cluster_preset, load_recipe, model_preset
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.recipe import Recipe, model_from_dict, recipe_from_dict

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))

SEARCHES = [  # (model, cluster GPUs, global batch in sequences)
    (model_preset("tiny"), 8, 64),
    (model_preset("tiny").with_(tied_embeddings=True, layers=4), 8, 64),
    (model_preset("tiny-moe").with_(layers=4), 8, 64),
    (model_preset("llama3-8b"), 64, 256),
    (model_preset("mixtral-8x7b").with_(seq_len=4096), 64, 256),
    (model_preset("mixtral-8x7b").with_(seq_len=4096), 16, 64),
    (model_preset("gpt3-175b"), 128, 512),  # tied embeddings
]


def _searched(model, gpus: int, batch: int):
    cluster = cluster_preset("dgx-h100", gpus)
    result = search(model, cluster, global_batch=batch, top=10)
    return cluster, result


def _runtime_rule_violations(model, plan: ParallelPlan) -> list[str]:
    """The refusals written out independently of the validation (so dropping one fails)."""
    out = []
    if plan.ep > 1 and (plan.dp_shard * plan.cp * plan.tp) % plan.ep:
        out.append("ep outside dp_shard x cp x tp")
    if model.is_moe and plan.tp > 1 and (model.seq_len // plan.cp) % plan.tp:
        out.append("MoE tokens not split evenly over the TP ranks")
    return out


@pytest.mark.parametrize(
    ("model", "gpus", "batch"), SEARCHES, ids=[f"{m.name}-{g}" for m, g, _ in SEARCHES]
)
def test_searched_layouts_pass_the_one_validation(model, gpus, batch):
    cluster, result = _searched(model, gpus, batch)
    proposed = [result.best_plan, *(a.plan for a in result.alternatives)]
    assert len(proposed) >= 2
    # "batch" rejections miss the batch target before validation: neither valid nor invalid
    valid = [o.plan for o in result.outcomes.values() if o.kind in ("fits", "memory")]
    invalid = [o.plan for o in result.outcomes.values() if o.kind == "invalid"]
    for plan in proposed + valid:
        assert plan.problems(model, cluster) == [], plan.describe()
        assert _runtime_rule_violations(model, plan) == [], plan.describe()
    for plan in invalid:
        assert plan.problems(model, cluster), plan.describe()
    if model.is_moe:  # MoE under TP runs (geometry's expert rule): the search weighs it
        assert any(p.tp > 1 for p in valid)
    if model.tied_embeddings and gpus >= 128:  # tied pipelines are proposed, no longer refused
        assert any(p.pp > 1 for p in valid)


def _runtime_refusal(recipe: Recipe) -> str | None:
    """The ConfigError the distributed runtime raises for `recipe` before any collective (None
    if it got past its checks, which here means it tried to start a process group)."""
    import torch.distributed as dist

    from fivefold.parallel.distributed_runtime import DistributedRuntime

    assert not dist.is_initialized()
    settings = SimpleNamespace(device="cpu", seed=0, steps=1, memory_step=2)
    try:
        DistributedRuntime(recipe, settings)
    except ConfigError as err:
        return str(err)
    except RuntimeError as err:  # the patched process-group start: the checks passed
        assert "checks passed" in str(err), err
        return None
    raise AssertionError("a runtime was built without a process group")


def test_the_runtime_refuses_exactly_what_validation_refuses(monkeypatch):
    """Candidates of the searches, valid and invalid: the runtime's verdict is validation's."""
    import fivefold.parallel.distributed_runtime as runtime_module

    def no_group(*args, **kwargs):
        raise RuntimeError("checks passed: would start a process group now")

    monkeypatch.setattr(runtime_module, "init_distributed", no_group)
    rng = random.Random(0)
    checked = {"valid": 0, "invalid": 0}
    for model, gpus, batch in SEARCHES[:3] + SEARCHES[4:5]:
        cluster, result = _searched(model, gpus, batch)
        outcomes = [o for o in result.outcomes.values() if o.kind != "batch"]
        for outcome in rng.sample(outcomes, min(25, len(outcomes))):
            plan = outcome.plan.with_(precision="fp32")
            recipe = Recipe(model, cluster, plan, {"train": {"device": "cpu"}})
            problems = plan.problems(model, cluster)
            refusal = _runtime_refusal(recipe)
            if problems:
                assert refusal is not None and all(p in refusal for p in problems)
                checked["invalid"] += 1
            else:
                assert refusal is None, refusal
                checked["valid"] += 1
    assert checked["valid"] >= 20 and checked["invalid"] >= 20, checked


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"plan": {"precision": "fp8-mixed"}}, "computes in fp8"),
        ({"plan": {"cp": 2, "cp_kind": "ulysses", "tp": 4}}, "Ulysses"),
    ],
)
def test_runtime_refusals_are_recipe_refusals(changes, needle):
    """What fivefold's runtime does not implement is refused at recipe load (before any
    process), and by the single-process runtime with the same words."""
    from fivefold.train.config import TrainConfig
    from fivefold.train.runtime import LocalRuntime

    data = {"model": {"preset": "tiny"}, "plan": {}, **changes}
    world = ParallelPlan(**data["plan"]).world_size
    with pytest.raises(ConfigError, match=needle):
        recipe_from_dict(data, default_world=world)
    if world == 1:
        model = model_from_dict(data["model"])
        plan = ParallelPlan(**data["plan"])
        cluster = cluster_preset("dgx-h100", 1)
        with pytest.raises(ConfigError, match=needle):
            LocalRuntime(Recipe(model, cluster, plan), TrainConfig(device="cpu"))


def test_published_runs_of_other_software_are_not_held_to_the_runtime_rules():
    """A published run fivefold's runtime cannot run (fp8 compute) is costed with
    runtime=False and refused with runtime=True; Megatron's tied-embedding pipelines, which
    fivefold runs too, are costed either way."""
    from fivefold.planner.budget.published import run_setups
    from fivefold.planner.estimate import estimate

    setups = run_setups()
    refused = [s for s in setups if s.plan.runtime_problems(s.model)]
    assert refused
    setup = refused[0]
    assert estimate(setup.model, setup.cluster, setup.plan, runtime=False).step_time_s > 0
    with pytest.raises(ConfigError):
        estimate(setup.model, setup.cluster, setup.plan)
    tied_pp = [s for s in setups if s.model.tied_embeddings and s.plan.pp > 1]
    assert tied_pp and not any(s.plan.runtime_problems(s.model) for s in tied_pp)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_recipe_in_configs_loads_and_validates(path):
    """GPU recipes name their cluster; CPU recipes run on as many processes as the plan needs."""
    from fivefold.specs.recipe import read_toml

    world = ParallelPlan(**read_toml(path).get("plan", {})).world_size
    recipe = load_recipe(path, default_world=world)
    assert recipe.plan.problems(recipe.model, recipe.cluster) == []
    assert recipe.plan.world_size == recipe.cluster.world_size


# ---- one preset expansion for `fivefold plan` and TOML ------------------------------------------
def _plan_args(**flags) -> argparse.Namespace:
    from fivefold.cli.main import build_parser

    argv = ["plan"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("flags", "toml"),
    [
        ({"model": "llama3-8b", "kv_heads": 4}, {"preset": "llama3-8b", "kv_heads": 4}),
        ({"model": "vizz-7b", "heads": 16}, {"preset": "vizz-7b", "heads": 16}),
        ({"model": "llama3-8b", "heads": 16}, {"preset": "llama3-8b", "heads": 16}),
        ({"model": "gpt3-175b", "hidden": 6144}, {"preset": "gpt3-175b", "hidden": 6144}),
        (
            {"model": "tiny-moe", "experts": 8, "seq": "1K"},
            {"preset": "tiny-moe", "experts": 8, "seq_len": 1024},
        ),
        (
            {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2},
            {
                "name": "custom",
                "layers": 4,
                "hidden": 256,
                "heads": 8,
                "kv_heads": 2,
                "vocab": 32000,
                "seq_len": 4096,
            },
        ),
    ],
)
def test_plan_flags_and_toml_give_the_same_model(flags, toml):
    from fivefold.cli.plan_inputs import model_from_args

    from_flags = model_from_args(_plan_args(**flags), {})
    from_toml = model_from_dict(toml)
    assert from_flags == from_toml
    # and the recipe path with the same table (what `fivefold train` reads)
    assert recipe_from_dict({"model": toml}, default_world=1).model == from_toml


def test_heads_override_keeps_multi_head_presets_multi_head_and_gqa_presets_gqa():
    assert model_from_dict({"preset": "vizz-7b", "heads": 16}).kv_heads == 16  # MHA stays MHA
    assert model_from_dict({"preset": "llama3-8b", "heads": 16}).kv_heads == 8  # GQA keeps 8
    assert model_from_dict({"preset": "llama3-8b", "kv_heads": 4}).kv_heads == 4
    assert model_from_dict({"preset": "vizz-7b", "heads": 16}).head_dim == 4096 // 16
