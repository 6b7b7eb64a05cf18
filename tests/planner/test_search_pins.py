"""A pinned degree the model or cluster cannot take: the search names the rule that emptied it
(in `ParallelPlan.problems`' own words), never a memory shortage or the memory levers."""

from __future__ import annotations

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.planner.search.layouts import search
from fivefold.specs import ParallelPlan, cluster_preset, model_preset

LONG_7B = model_preset("vizz-7b").with_(seq_len=131072)  # 32 heads, 32 layers, ffn 11008
H100x64 = cluster_preset("dgx-h100", 64)


def rules(plan: ParallelPlan) -> list[str]:
    return plan.problems(LONG_7B, H100x64)


def searched(**fixed) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        search(LONG_7B, H100x64, global_batch=32, fixed=fixed)
    return err.value


def test_tp_that_divides_neither_heads_nor_node_names_those_rules():
    err = searched(tp=5)
    heads = "plan.tp = 5 must divide model.heads = 32: each TP rank holds whole attention heads."
    node = next(p for p in rules(ParallelPlan(tp=5)) if "GPUs of a node" in p)
    assert heads in rules(ParallelPlan(tp=5))  # the validation's words, quoted as they are
    assert heads in err.problems and node in err.problems
    assert err.problems[0].startswith("no layout of vizz-7b on 64 x h100-sxm with the pinned")
    assert "(tp 5)" in err.problems[0]
    text = str(err)
    assert "memory" not in text and "levers" not in text and "fits" not in text


def test_pipeline_deeper_than_the_layers_names_that_rule():
    err = searched(pp=64)
    layers = next(p for p in rules(ParallelPlan(pp=64)) if "model.layers" in p)
    assert err.problems[1:] == [layers]


def test_degrees_whose_product_misses_the_gpus_name_the_product_rule():
    err = searched(tp=2, pp=3)  # 6 does not divide 64
    assert len(err.problems) == 2
    assert err.problems[1].startswith("plan degrees multiply to pp 3 x ")
    assert "but the cluster has 64 GPUs (8 nodes x 8)" in err.problems[1]


def test_a_valid_pin_still_plans():
    result = search(LONG_7B, H100x64, global_batch=32, fixed={"tp": 4})
    assert result.best_plan.tp == 4


def test_cli_reports_the_rule_not_memory(capsys):
    argv = ["plan", "--model", "vizz-7b", "--gpus", "64", "--seq", "128K", "--tp", "5"]
    assert main([*argv, "--global-batch", "32"]) == 2
    err = capsys.readouterr().err
    assert "plan.tp = 5 must divide model.heads = 32" in err
    assert "fits" not in err and "memory levers" not in err and "Traceback" not in err


def test_a_pinned_dp_no_shape_reaches_names_the_product_rule():
    err = searched(tp=2, dp=3)  # before: "No candidate layout exists ... memory levers"
    assert err.problems[1] == next(
        p for p in rules(ParallelPlan(tp=2, dp_replicate=3)) if p.startswith("plan degrees")
    )
    assert "= 6, but the cluster has 64 GPUs" in err.problems[1]


def test_a_pinned_dualpipev_is_searched_for_a_dense_model():
    """The search skips DualPipeV for dense models (ZBV's bubble, one more chunk in flight), but
    a pinned one is searched, not refused with another layout's rules."""
    result = search(LONG_7B, H100x64, global_batch=32, fixed={"pp": 4, "schedule": "dualpipev"})
    assert (result.best_plan.pp, result.best_plan.schedule, result.best_plan.vpp) == (
        4,
        "dualpipev",
        2,
    )
    unpinned = search(LONG_7B, H100x64, global_batch=32, fixed={"pp": 4})
    assert all(o.plan.schedule != "dualpipev" for o in unpinned.search_state.outcomes.values())
