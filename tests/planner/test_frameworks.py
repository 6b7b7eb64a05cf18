"""Efficiency profiles: each one's options are what its documentation says, they agree with the
published runs that record the same software, and resolving profile + recipe + flags states
every replacement."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.budget.published import run_setup
from fivefold.planner.estimate import estimate
from fivefold.planner.frameworks import (
    DEFAULT_PROFILE,
    PROFILES_FILE,
    planner_settings,
    profile,
    profiles,
    row_options,
)
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import published_runs
from fivefold.specs import cluster_preset
from fivefold.specs.cluster import profile_cluster
from fivefold.specs.hardware import gpu
from fivefold.specs.profile import parse_profile

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
H100 = gpu("h100-sxm")

# What docs/planner.md's table says of each profile, field by field (hand-copied, so a change
# to the data or to the docs without the other fails here).
DOCUMENTED = {
    "megatron-2022": dict(
        attention_kernel="classic",
        dropout=True,
        tp_comm_overlap=False,
        dp_overlap=True,
        fused_elementwise=True,
        selective_policy="attention",
        collective_granularity="layer",
    ),
    "nemo-2024": dict(
        attention_kernel="flash",
        dropout=False,
        tp_comm_overlap=True,
        dp_overlap=True,
        fused_elementwise=True,
        selective_policy="attention",
        collective_granularity="layer",
    ),
    "torchtitan": dict(
        attention_kernel="flash",
        dropout=False,
        tp_comm_overlap=False,
        dp_overlap=True,
        fused_elementwise=False,
        selective_policy="alternate-matmul",
        collective_granularity="layer",
    ),
}


def test_the_shipped_profiles_and_the_default():
    assert list(profiles()) == ["megatron-2022", "nemo-2024", "torchtitan", "fivefold"]
    assert DEFAULT_PROFILE == "fivefold"
    data = json.loads(PROFILES_FILE.read_text())
    assert "fivefold.planner.frameworks.DEFAULT_PROFILE" in data["description"]


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_profile_sets_what_its_docs_say(name):
    options = profile(name).planner_options(H100)
    expected = PlannerOptions(**DOCUMENTED[name])
    assert options == expected
    # The rest keep PlannerOptions' defaults (bucket size, memory terms).
    assert options.dp_bucket_bytes == 25 * 2**20
    assert options.cuda_context_bytes == 0.75 * 2**30


def test_docs_table_lists_the_same_values():
    """docs/planner.md has one row per profile: name | attention | dropout | TP overlap | DP
    overlap | fused | selective | granularity."""
    text = DOCS.read_text()
    gpu_defaults = asdict(profile("fivefold").planner_options(H100))
    for name, fields in {**DOCUMENTED, "fivefold": gpu_defaults}.items():
        row = re.search(rf"^\| `{re.escape(name)}`(?: \(GPU\))? \|(.*)$", text, re.M)
        assert row, f"docs/planner.md has no row for {name}"
        cells = [c.strip() for c in row.group(1).split("|")[:7]]
        words = {True: "yes", False: "no"}
        expected = [
            fields["attention_kernel"],
            words[fields["dropout"]],
            words[fields["tp_comm_overlap"]],
            words[fields["dp_overlap"]],
            words[fields["fused_elementwise"]],
            fields["selective_policy"],
            fields["collective_granularity"],
        ]
        assert cells == expected, name


def test_fivefold_is_what_for_device_gives():
    assert profile("fivefold").planner_options(H100) == PlannerOptions.for_device(H100)
    # fivefold's runtime as `fivefold train` runs it on a GPU: its eager memory, eager
    # element-wise ops, recompute stopping early; the other fields as the fused defaults
    # (flash attention, no dropout, TP exposed, DP overlapped)
    eager = PlannerOptions(
        runtime="fivefold-eager", fused_elementwise=False, checkpoint_early_stop=True
    )
    assert profile("fivefold").planner_options(H100) == eager
    # compiled blocks (train.compile): inductor keeps less and fuses the element-wise work
    compiled = profile("fivefold").planner_options(H100, compile=True)
    assert compiled == PlannerOptions(
        runtime="fivefold-eager", fused_elementwise=True, checkpoint_early_stop=True, compile=True
    )
    assert eager.fivefold_runtime and compiled.fivefold_runtime
    for name in ("megatron-2022", "nemo-2024", "torchtitan"):  # other software
        assert not profile(name).planner_options(H100).fivefold_runtime, name


def test_fivefold_on_a_measured_cpu_is_the_eager_runtime(tmp_path):
    from test_profile import synthetic

    path = tmp_path / "device.toml"
    path.write_text(parse_profile(synthetic()).to_toml())
    device = profile_cluster(str(path), 2).device
    options = profile("fivefold").planner_options(device)
    assert options == PlannerOptions.for_device(device)
    assert options.runtime == "fivefold-eager" and options.dp_overlap is False


# ---- the published runs ---------------------------------------------------------------------
ROW_PROFILE = {**{i: "megatron-2022" for i in range(1, 11)}}
ROW_PROFILE |= {i: "nemo-2024" for i in range(36, 45)}
ROW_PROFILE |= {60: "torchtitan", 61: "torchtitan"}


def _rows() -> dict:
    return {int(row["id"]): row for row in published_runs() if row["id"].isdigit()}


@pytest.mark.parametrize("row_id", sorted(ROW_PROFILE))
def test_published_rows_agree_with_their_profile(row_id):
    """Every option a row records is the value of the profile of its software."""
    row = _rows()[row_id]
    options = asdict(profile(ROW_PROFILE[row_id]).planner_options(H100))
    assert {k: options[k] for k in row["options"]} == row["options"]


@pytest.mark.parametrize("row_id", [1, 7, 36, 44])
def test_a_row_naming_its_profile_estimates_as_before(row_id):
    row = _rows()[row_id]
    before = run_setup(row)
    by_name = run_setup(
        {**{k: v for k, v in row.items() if k != "options"}, "profile": ROW_PROFILE[row_id]}
    )
    assert by_name.options == before.options
    old = estimate(before.model, before.cluster, before.plan, before.options, runtime=False)
    new = estimate(by_name.model, by_name.cluster, by_name.plan, by_name.options, runtime=False)
    assert new.step_time_s == old.step_time_s
    assert new.peak_memory_bytes == old.peak_memory_bytes


def test_a_row_option_replaces_its_profiles():
    row = {"id": 0, "profile": "megatron-2022", "options": {"dropout": False}}
    options = row_options(row, H100)
    assert options.dropout is False and options.attention_kernel == "classic"
    with pytest.raises(ConfigError, match="row 0 profile = 'x' is not an efficiency profile"):
        row_options({"id": 0, "profile": "x"}, H100)


# ---- resolution: profile < recipe [planner] < flags ------------------------------------------
def test_default_settings_are_the_fivefold_profile():
    s = planner_settings(H100)
    assert s.profile == "fivefold" and s.options == PlannerOptions.for_device(H100)
    assert s.notes == () and s.headroom is None and s.overrides == {}
    assert "It plans fivefold's own runtime (eager)" in s.describe()
    compiled = planner_settings(H100, compile=True)  # a recipe's train.compile
    assert compiled.options.compile and compiled.overrides == {}
    assert "It plans fivefold's own runtime (compiled blocks)" in compiled.describe()
    other = planner_settings(H100, profile_flag="megatron-2022")
    assert "It plans other software (Megatron-LM" in other.describe()
    fused = planner_settings(H100, flags={"runtime": "fused"})
    assert "It plans other software (fused-kernel software" in fused.describe()


def test_flag_wins_over_recipe_which_wins_over_profile_and_each_is_stated():
    s = planner_settings(
        H100,
        {"profile": "torchtitan", "attention_kernel": "classic", "dropout": True, "headroom": 0.2},
        {"attention_kernel": "flash", "dp_bucket_bytes": 100 * 2**20, "dropout": None},
        profile_flag="nemo-2024",
    )
    assert s.profile == "nemo-2024"  # --profile beats planner.profile
    assert s.options.attention_kernel == "flash"  # the flag beats the recipe
    assert s.options.dropout is True  # the recipe beats the profile; None = flag not given
    assert s.options.tp_comm_overlap is True  # nemo-2024's own
    assert s.headroom == 0.2
    assert s.overrides == {"dropout": True, "dp_bucket_bytes": 100 * 2**20}
    assert s.notes == (
        "attention_kernel = classic (planner.attention_kernel, replacing nemo-2024's flash)",
        "dropout = true (planner.dropout, replacing nemo-2024's false)",
        "attention_kernel = flash (--attention-kernel, replacing the recipe's classic)",
        "dp_bucket_bytes = 100 MiB (--dp-bucket-bytes, replacing nemo-2024's 25 MiB)",
    )
    assert "Efficiency profile nemo-2024:" in s.describe()
    assert "dropout = true (planner.dropout" in s.describe()
    assert s.section() == {
        "profile": "nemo-2024",
        "headroom": 0.2,
        "dropout": True,
        "dp_bucket_bytes": 100 * 2**20,
    }


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"profile": "megatron"}, "planner.profile = 'megatron' is not an efficiency profile"),
        ({"atention_kernel": "flash"}, "planner.atention_kernel is not a setting"),
        ({"attention_kernel": "sparse"}, "planner.attention_kernel = 'sparse': choose one of"),
        ({"dropout": 1}, "planner.dropout = 1: expected true or false"),
        ({"tp_comm_overlap": "yes"}, "planner.tp_comm_overlap = 'yes': expected true or false"),
        ({"dp_bucket_bytes": float("nan")}, "planner.dp_bucket_bytes = nan: expected a finite"),
        ({"dp_bucket_bytes": -5}, "planner.dp_bucket_bytes = -5.0: must be a finite number >= 0"),
        ({"fragmentation_fraction": 1.5}, "planner.fragmentation_fraction = 1.5: must be in"),
        ({"collective_granularity": "step"}, "planner.collective_granularity = 'step': choose"),
        ({"headroom": float("nan")}, "planner.headroom = nan: must be a fraction in [0, 1)"),
        ({"headroom": True}, "planner.headroom = True: must be a fraction in [0, 1)"),
    ],
)
def test_bad_planner_tables_name_the_field(section, words):
    with pytest.raises(ConfigError) as err:
        planner_settings(H100, section)
    assert any(words in p for p in err.value.problems), err.value.problems


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        planner_settings(H100, {"profile": "x", "dropout": 2, "nope": 1})
    assert len(err.value.problems) == 3


def test_cluster_preset_device_is_a_catalog_gpu():
    assert cluster_preset("dgx-h100", 8).device.rank_profile is None


# ---- which software is planned ---------------------------------------------------------------
MOE_TP = ["plan", "estimate", "--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2"]
MOE_TP += ["--ep", "8", "--zero", "3", "--global-batch-tokens", "4M"]
FP8_RECIPE = ["--precision", "fp8-mixed"]


def test_framework_profiles_plan_what_fivefold_refuses(capsys):
    from fivefold.cli.main import main

    # fivefold's runtime computes in fp32 or bf16: its profile refuses an fp8 recipe
    assert main([*MOE_TP, *FP8_RECIPE]) == 2
    assert "which fivefold's runtime does not implement" in capsys.readouterr().err
    # Megatron's profile plans it and says which software that is
    assert main([*MOE_TP, *FP8_RECIPE, "--profile", "megatron-2022"]) == 0
    out = capsys.readouterr().out
    assert "TP2+SP" in out and "EP8" in out
    assert "It plans other software (Megatron-LM 2021-2022" in out


def test_moe_with_tp_is_planned_for_fivefold_and_searched(capsys):
    from fivefold.cli.main import main

    # MoE under TP runs in fivefold (geometry's expert rule): its profile plans the layout
    assert main(MOE_TP) == 0
    assert "TP2+SP" in capsys.readouterr().out
    # and its search, with TP pinned, proposes such layouts
    search = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2"]
    assert main([*search, "--global-batch-tokens", "4M"]) == 0
    assert "best layout: TP2+SP" in capsys.readouterr().out


def test_the_profile_line_speaks_to_users_not_in_internal_names():
    """`plan` prints "Efficiency profile NAME: summary"; it read "what PlannerOptions.for_device
    gives" for the default profile."""
    for name, prof in profiles().items():
        assert not re.search(r"PlannerOptions|for_device|\w+\.\w+\(", prof.summary), name
