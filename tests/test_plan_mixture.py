"""`fivefold plan --tokens` with a data mixture: tokens and epochs per source beside the budget."""

from __future__ import annotations

import json

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import BudgetInputs, budget
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.mixture import parse_mixture

LAYOUT = [
    "--model", "llama3-8b", "--seq", "8192", "--cluster", "dgx-h100", "--gpus", "16",
    "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--dp", "4", "--zero", "1",
    "--mbs", "1", "--global-batch", "64", "--recompute", "selective",
]  # fmt: skip
SOURCES = ["web=6:300B", "books=1.5:20B", "wiki=0.5:5B", "code=2"]


def test_budget_draws_each_source_by_its_normalised_weight():
    mixture = (("web", 6, 3e11), ("books", 1.5, 2e10), ("wiki", 0.5, 5e9), ("code", 2, None))
    plan = ParallelPlan(tp=2, pp=2, dp_shard=4, zero=1, recompute="selective", grad_accum=16)
    b = budget(model_preset("llama3-8b"), cluster_preset("dgx-h100", 16), plan, 1.0,
               BudgetInputs(5e11, sources=mixture))  # fmt: skip
    got = {d.name: (d.weight, d.tokens, d.epochs, d.repeats_too_much) for d in b.sources}
    # weights 6 : 1.5 : 0.5 : 2 of 10 -> 0.6, 0.15, 0.05, 0.2 of 500B
    assert got == {
        "web": (0.6, 3e11, 1.0, False),
        "books": (0.15, 7.5e10, 3.75, False),
        "wiki": (0.05, 2.5e10, 5.0, True),  # past 4 epochs
        "code": (0.2, 1e11, None, False),
    }
    assert b.to_json()["sources"][1]["epochs"] == 3.75
    plain = budget(model_preset("llama3-8b"), cluster_preset("dgx-h100", 16), plan, 1.0,
                   BudgetInputs(5e11))  # fmt: skip
    assert "sources" not in plain.to_json()


def test_plan_prints_and_carries_tokens_per_source(capsys):
    flags = [f"--source={s}" for s in SOURCES]
    assert main(["plan", "estimate", *LAYOUT, "--tokens", "500B", *flags, "--json"]) == 0
    sources = json.loads(capsys.readouterr().out)["budget"]["sources"]
    assert [(s["name"], s["tokens"], s["epochs"]) for s in sources] == [
        ("web", 3e11, 1.0), ("books", 7.5e10, 3.75), ("wiki", 2.5e10, 5.0), ("code", 1e11, None)
    ]  # fmt: skip
    assert main(["plan", "estimate", *LAYOUT, "--tokens", "500B", *flags]) == 0
    out = capsys.readouterr().out
    assert "books: weight 0.150, 75B tokens, 3.75 epochs of 20B" in out
    assert "wiki: weight 0.050, 25B tokens, 5.00 epochs of 5B; warning: more than 4 epochs" in out


def test_a_recipe_mixture_reads_each_source_size_from_its_shards(tmp_path, capsys):
    web = tmp_path / "web"
    web.mkdir()
    (web / "manifest.json").write_text(json.dumps({"num_tokens": 2e11}))
    recipe = tmp_path / "r.toml"
    books = '{ name = "books", inputs = ["b.jsonl"], weight = 1 }'
    recipe.write_text(
        f'[model]\npreset = "llama3-8b"\n[data]\nsources = [{{ shards = "{web}", weight = 3 }}, '
        f"{books}]\n"
    )
    assert main(["plan", "estimate", str(recipe), *LAYOUT[2:], "--tokens", "1T", "--json"]) == 0
    sources = json.loads(capsys.readouterr().out)["budget"]["sources"]
    assert [(s["name"], s["tokens"], s["epochs"]) for s in sources] == [
        ("web", 7.5e11, 3.75), ("books", 2.5e11, None)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "needle"),
    [
        ("--source=web=-1", "--source[0] ('web'): weight = -1.0 must be a finite number >= 0"),
        ("--source=web=nan", "--source[0] ('web'): weight = nan"),
        ("--source=web", "--source 'web': write NAME=WEIGHT"),
        ("--source=web=0", "--source: every weight is 0"),
    ],
)
def test_bad_sources_are_refused_naming_them(capsys, flag, needle):
    assert main(["plan", "estimate", *LAYOUT, "--tokens", "500B", flag]) == 2
    assert needle in capsys.readouterr().err


def test_mixture_tables_name_their_problems():
    with pytest.raises(ConfigError, match=r"planner.sources\[1\] \('b'\): tokens = -5"):
        parse_mixture([{"name": "a", "weight": 1}, {"name": "b", "weight": 1, "tokens": -5}])
    assert parse_mixture([{"name": "a", "weight": 2, "tokens": 10}]) == (("a", 2.0, 10.0),)
