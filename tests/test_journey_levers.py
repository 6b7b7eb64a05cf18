"""A new user's pass over the memory levers, planner options and `fivefold tune`.

Each test is a bug found by following README.md and docs/ literally, fixed, and pinned here:
the search never tried `offload = "all"` and refused `--offload all` pins; a torchao that is
installed but fails to import gave a traceback; `fivefold tune` crashed on a NaN limit and
refused overrides written before its options.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.errors import ConfigError
from fivefold.planner.search.candidates import AUTO_LEVERS, lever_sets
from fivefold.planner.search.layouts import search
from fivefold.specs.cluster import cluster_preset
from fivefold.specs.presets import model_preset

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml")


def test_search_tries_every_memory_lever_when_nothing_fits():
    # offload "all" needs ZeRO-3 over >= 2 ranks: a rule of each layout, not of the lever
    sets = lever_sets(model_preset("llama3-70b"), cluster_preset("dgx-h100", 64), {})
    assert sets == AUTO_LEVERS
    assert {"offload": "all"} in sets and {"optimizer_states": "8bit", "offload": "all"} in sets


def test_search_can_pick_offload_all_when_nothing_fits_without_levers():
    model, cluster = model_preset("llama3-405b"), cluster_preset("dgx-h100", 64)
    plain = {"offload": "none", "optimizer_states": "fp32"}
    with pytest.raises(ConfigError, match="no layout of llama3-405b fits"):
        search(model, cluster, global_batch_tokens=2**20, fixed=plain)
    best = search(model, cluster, global_batch_tokens=2**20).best
    assert best.plan.offload == "all" and best.plan.zero == 3 and best.plan.dp_shard >= 2
    assert best.fits


def test_plan_with_offload_all_pinned_searches_zero3_layouts(capsys):
    code = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--offload", "all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["plan"]["offload"] == "all" and out["plan"]["zero"] == 3
    assert out["plan"]["dp_shard"] * out["plan"]["dp_replicate"] == 8 // out["plan"]["tp"]


def _run(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def test_torchao_that_fails_to_import_is_refused_with_a_message(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "torchao"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    args = ["train", TINY, f"train.runs_dir={str(tmp_path)!r}", "plan.optimizer_states='8bit'"]
    code, err = _run(args, capsys)
    assert code == 2, err
    assert "plan.optimizer_states = '8bit' needs torchao, which is installed but fails" in err
    assert "built for another torch" in err and "Traceback" not in err


def test_missing_torchao_is_refused_with_the_install_command(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    args = ["train", TINY, f"train.runs_dir={str(tmp_path)!r}", "plan.optimizer_states='fp8'"]
    code, err = _run(args, capsys)
    assert code == 2
    assert "needs torchao, which is not installed: `pip install 'fivefold[lowbit]'`" in err


@pytest.mark.parametrize("limit", ["nan", "inf"])
def test_tune_refuses_a_limit_that_is_not_a_number(limit, capsys):
    code, err = _run(["tune", TINY, "--memory-limit", limit], capsys)
    assert code == 2
    assert f"--memory-limit {limit}: must be a positive number of GiB" in err


def test_tune_reads_overrides_written_before_its_options(capsys):
    code, err = _run(
        ["tune", TINY, "plan.dp_shard=2", "plan.zero=3", "--memory-limit", "1"], capsys
    )
    assert code == 2
    assert "fivefold tune runs one process" in err  # the override was read, not refused


def test_tune_chooses_the_largest_micro_batch_under_the_limit(tmp_path, capsys):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(Path(TINY).read_text())
    # full recompute on `tiny`: micro-batch 1 peaks at 0.0133 GiB, 2 at 0.0174 (measured)
    args = ["tune", str(recipe), "plan.recompute='full'", "--policies", "full"]
    code = main([*args, "--memory-limit", "0.015", "--max-micro-batch", "2", "--write"])
    out = capsys.readouterr().out
    assert code == 0
    assert "choice: plan.micro_batch = 1, plan.recompute = 'full'" in out
    text = recipe.read_text()
    assert "micro_batch = 1" in text and 'recompute = "full"' in text


def test_wandb_without_credentials_is_refused_before_training(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    args = ["train", TINY, f"train.runs_dir={str(tmp_path)!r}", "train.trackers=['wandb']"]
    code, err = _run(args, capsys)
    assert code == 2
    assert "'wandb' has no W&B credentials here" in err and "WANDB_MODE=offline" in err
    assert not (tmp_path / "tiny-cpu").exists()  # refused before any run directory
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    from fivefold.train.trackers import tracker_problems

    assert tracker_problems(["wandb"]) == []  # `wandb login`'s entry is enough


def test_zero_bubble_explanation_prints_no_negative_time(capsys):
    # zbv's bubble in the breakdown is 0 less a rounding error (-1.7e-13 s): once "-0 us"
    args = ["plan", "--model", "llama3-70b", "--gpus", "64", "--global-batch-tokens", "4M"]
    layout = ["--tp", "4", "--pp", "2", "--schedule", "zbv", "--zero", "2", "--mbs", "1"]
    code = main([*args, *layout, "--offload", "optimizer", "--optimizer-states", "8bit"])
    out = capsys.readouterr().out
    assert code == 0
    assert "PP = 2 stages in 4 chunks (21/20/20/19 layers each), 2 per rank, with zbv" in out
    # the fraction and the seconds are one figure: once "1.4% of the pipeline time (0 s ..."
    said = re.search(
        r"bubble is (\d+\.\d)% of the pipeline time \((\d[\d.]*) (s|ms|us) per step", out
    )
    assert said and said.group(1) == "0.0" and "(-0 " not in out and "(-" not in out


def test_explorer_search_takes_the_risk_setting_as_the_cli_does():
    from fivefold.explore.api import ApiError, search_view

    body = {"model": {"preset": "llama3-8b"}, "cluster": {"preset": "dgx-h100"}, "top": 2}
    body["global_batch"] = 64
    for risk in ("pessimistic", "expected"):
        answer = search_view({**body, "risk": risk})
        assert answer["ok"] and answer["risk"] == risk
        assert (
            answer["best"]["plan"]
            == search(
                model_preset("llama3-8b"), cluster_preset("dgx-h100", 8), global_batch=64, risk=risk
            ).best.plan.to_dict()
        )
    with pytest.raises(ApiError, match="risk = 'wild': choose 'pessimistic'"):
        search_view({**body, "risk": "wild"})
    with pytest.raises(ApiError, match="risk = "):
        search_view({**body, "risk": ["expected"]})


def test_train_help_names_every_train_and_data_field(capsys):
    from dataclasses import fields

    from fivefold.train.config import DataConfig, TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for cls, head in ((TrainConfig, "[train] fields:"), (DataConfig, "[data] fields:")):
        listed = text.split(head)[1].split("fields:")[0].split("On CPU")[0]
        missing = [f.name for f in fields(cls) if f.name not in listed]
        assert missing == [], f"{head} misses {missing}"


def test_tune_measures_the_recipe_with_its_memory_levers():
    from fivefold.train.tune import TuneSession, load_trial_run, tune_policy

    def peak(*overrides: str) -> int:
        session = TuneSession(
            str(TINY), list(overrides), load_trial_run(str(TINY), list(overrides), 1, "none")
        )
        return tune_policy(session, "none", 2**30, 1)[0].peak_bytes

    fp32 = peak()
    # m and v of `tiny` (616,768 parameters): 4,934,144 bytes in fp32, 1,328,192 in 8 bits
    # (docs/memory-levers.md); offloading the step adds a 4-byte host master per parameter
    assert fp32 - peak("plan.optimizer_states='8bit'") == 4_934_144 - 1_328_192
    assert peak("plan.offload='optimizer'") - fp32 == 616_768 * 4
