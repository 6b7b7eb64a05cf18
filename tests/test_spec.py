"""Parameter and FLOP counts against published and hand-derived values; recipe round trip."""

import dataclasses

import pytest

from fivefold.errors import ConfigError
from fivefold.specs import (
    MODEL_PRESETS,
    ParallelPlan,
    cluster_preset,
    dump_recipe,
    load_recipe,
    model_preset,
    param_count,
    training_flops_per_token,
)
from fivefold.specs.flops import forward_flops_per_token
from fivefold.specs.recipe import read_toml, recipe_from_dict


@pytest.mark.parametrize(
    ("name", "published", "tolerance"),
    [
        ("llama3-8b", 8.03e9, 0.005e9),  # Meta: 8.03B
        ("llama3-70b", 70.6e9, 0.1e9),  # Meta: 70.6B
        ("llama3-405b", 405.9e9, 0.1e9),  # Meta: 405.9B (406B)
        ("mixtral-8x7b", 46.7e9, 0.1e9),  # Mistral: 46.7B total
        ("deepseek-v3", 671e9, 0.5e9),  # DeepSeek: 671B (without the MTP module)
        ("gpt3-175b", 175e9, 0.5e9),  # Brown et al. 2020: 175B
    ],
)
def test_published_parameter_counts(name, published, tolerance):
    assert abs(param_count(model_preset(name)) - published) <= tolerance


def test_llama3_8b_exact_count_by_hand():
    # embedding + head: 2 * 128256 * 4096; per layer q,o 4096^2 each, k,v 4096*1024 each,
    # SwiGLU 3 * 4096 * 14336, two norms 2 * 4096; final norm 4096.
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert expected == 8_030_261_248
    assert param_count(model_preset("llama3-8b")) == expected


def test_active_parameters_of_moe():
    mixtral = model_preset("mixtral-8x7b")
    assert abs(param_count(mixtral, active_only=True) - 12.9e9) < 0.05e9  # Mistral: 12.9B active
    deepseek = model_preset("deepseek-v3")
    assert abs(param_count(deepseek, active_only=True) - 37e9) < 1e9  # DeepSeek: 37B active


def test_llama3_8b_flops_by_hand():
    m = model_preset("llama3-8b")
    s = 8192
    matmul_per_layer = 2 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    causal_scores_per_layer = 4 * 32 * 128 * (s / 2)  # QK^T and AV, s/2 keys on average
    head = 2 * 128256 * 4096
    forward = 32 * (matmul_per_layer + causal_scores_per_layer) + head
    assert forward_flops_per_token(m, s) == pytest.approx(forward, rel=1e-12)
    assert training_flops_per_token(m, s) == pytest.approx(3 * forward, rel=1e-12)
    full = 3 * forward + 32 * (matmul_per_layer + causal_scores_per_layer)
    assert training_flops_per_token(m, s, "full") == pytest.approx(full, rel=1e-12)
    selective = 3 * forward + 32 * causal_scores_per_layer
    assert training_flops_per_token(m, s, "selective") == pytest.approx(selective, rel=1e-12)
    # Close to the 6N rule plus attention: 6 * 8.03e9 = 48.2e9 per token.
    assert 48e9 < training_flops_per_token(m, s) < 52e9


def test_non_causal_attention_counts_twice_the_scores():
    m = model_preset("tiny")
    delta = forward_flops_per_token(m, causal=False) - forward_flops_per_token(m)
    assert delta == pytest.approx(m.layers * 4 * m.heads * m.head_dim * m.seq_len / 2)


def test_every_preset_is_valid():
    for spec in MODEL_PRESETS.values():
        assert spec.problems() == [], spec.name


def test_recipe_round_trip(tmp_path):
    recipe = load_recipe(
        None,
        ["model.preset=small", "plan.tp=2", "plan.zero=1", "plan.dp_shard=2", "train.steps=7"],
        default_world=4,
    )
    path = tmp_path / "r.toml"
    path.write_text(dump_recipe(recipe, header="written by a test"))
    again = recipe_from_dict(read_toml(path))
    assert again.model == recipe.model
    assert again.plan == recipe.plan
    assert again.cluster == recipe.cluster
    assert again.section("train") == {"steps": 7}
    assert again.plan.world_size == 4


def test_validation_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        load_recipe(None, ["model.preset=small", "plan.zero=7", "plan.schedule=zigzag"])
    assert len(err.value.problems) == 2
    assert "plan.zero = 7" in str(err.value)
    assert "plan.schedule = 'zigzag'" in str(err.value)


def test_plan_world_size_mismatch_names_the_numbers():
    plan = ParallelPlan(tp=2, pp=2, dp_replicate=2)
    recipe = load_recipe(None, ["model.preset=small", "plan.dp_replicate=4"], default_world=4)
    problems = plan.problems(recipe.model, recipe.cluster)
    assert any("= 8, but the cluster has 4 GPUs" in p for p in problems)


def test_wrong_type_for_a_field_with_choices_names_them():
    data = {
        "model": {"preset": "tiny"},
        "cluster": {"preset": "cpu", "nodes": 1, "gpus_per_node": 1},
        "plan": {"offload": 1, "zero": "3", "tp": "2"},
    }
    with pytest.raises(ConfigError) as err:
        recipe_from_dict(data)
    text = str(err.value)
    assert "plan.offload = 1: expected a string; choose one of 'none', 'optimizer', 'all'." in text
    assert "plan.zero = '3': expected a whole number; choose one of 0, 1, 2, 3." in text
    assert "plan.tp = '2': expected a whole number." in text  # no fixed set of values


def test_plan_reports_cross_field_and_layout_problems_together():
    plan = ParallelPlan(tp=3, fp8="tensorwise", precision="fp32")
    problems = plan.problems(model_preset("llama3-8b"), cluster_preset("dgx-h100", 8))
    text = "\n".join(problems)
    assert "plan.fp8 = 'tensorwise' with plan.precision = 'fp32'" in text  # the plan alone
    assert "plan.tp = 3 must divide model.heads = 32" in text  # the plan against the model
    assert "plan.tp = 3 must divide the 8 GPUs of a node" in text  # ... against the cluster
    # A field bad alone still stops the checks that would read it, without crashing.
    bad = ParallelPlan(tp="3", fp8="e4m3")  # type: ignore[arg-type]
    assert len(bad.problems(model_preset("llama3-8b"), cluster_preset("dgx-h100", 8))) == 2
    # validate: a bad model keeps the plan's own problems, not its checks against that model.
    broken = dataclasses.replace(model_preset("llama3-8b"), heads=0)
    with pytest.raises(ConfigError) as err:
        plan.validate(broken, cluster_preset("dgx-h100", 8))
    assert "plan.fp8 = 'tensorwise' with plan.precision = 'fp32'" in str(err.value)
    assert "model.heads" in str(err.value)


@pytest.mark.parametrize(
    ("gpus", "per_node", "expected"),
    [(4, 8, (1, 4)), (8, 8, (1, 8)), (16, 8, (2, 8)), (8, 4, (2, 4)), (12, 8, None)],
)
def test_one_node_rule_for_recipes_flags_and_presets(gpus, per_node, expected):
    """A recipe's [cluster], `plan`'s --gpus/--gpus-per-node and a preset split GPUs into nodes
    by one rule (`node_split`): fewer GPUs than a node holds are one node of them; more must
    fill whole nodes, refused naming the field."""
    import argparse

    from fivefold.cli.plan_inputs import cluster_from_args
    from fivefold.specs.cluster import node_split
    from fivefold.specs.recipe import cluster_from_dict

    section = {"gpu": "h100-sxm", "gpus": gpus, "gpus_per_node": per_node}
    flags = argparse.Namespace(
        cluster=None, gpu="h100-sxm", gpus=gpus, gpus_per_node=per_node, nvlink_gbps=None,
        ib_gbps=None, nvlink_domain=None,
    )  # fmt: skip
    if expected is None:
        for build, field in (
            (lambda: cluster_from_dict(section), "cluster.gpus = 12"),
            (lambda: cluster_from_args(flags, {}), "--gpus = 12"),
            (lambda: node_split(gpus, per_node), "--gpus = 12"),
        ):  # fmt: skip
            with pytest.raises(ConfigError, match=field + " does not fill whole nodes of 8"):
                build()
        return
    recipe = cluster_from_dict(section)
    from_flags = cluster_from_args(flags, {})
    assert (recipe.nodes, recipe.gpus_per_node) == expected
    assert (from_flags.nodes, from_flags.gpus_per_node) == expected
    if per_node == 8:
        preset = cluster_preset("dgx-h100", gpus)
        assert (preset.nodes, preset.gpus_per_node) == expected
