"""`fivefold train --plan auto` on the machine at hand: it plans for the local
world size against the calibrated device profile, names that device, and without a profile says
how to make one (exit 2). The profile is the synthetic one of `tests/planner/test_profile.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.specs.profile import FORMAT, parse_profile

sys.path.insert(0, str(Path(__file__).parent / "planner"))
from test_profile import synthetic

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture
def profile(tmp_path, monkeypatch):
    path = tmp_path / "device-profile.toml"
    path.write_text(parse_profile(synthetic()).to_toml())
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(path))
    return path


@pytest.mark.parametrize("nproc", [1, 2])
def test_plan_auto_uses_the_local_world_and_the_profile(profile, nproc, capsys, tmp_path):
    # tiny-cpu.toml's own [plan] is one process; the search replaces its degrees for nproc.
    args = ["train", str(CONFIGS / "tiny-cpu.toml"), "--plan", "auto", "--nproc", str(nproc)]
    args += ["--dry-run", f'train.run_dir="{tmp_path}"']
    assert main(args) == 0
    out = capsys.readouterr().out
    chosen = next(line for line in out.splitlines() if line.startswith("--plan auto:"))
    assert f"planned for {nproc} x Test CPU" in chosen
    layout = next(line for line in out.splitlines() if line.startswith("layout:"))
    assert f"on {nproc} process(es)" in layout
    assert "8 sequences x 128 tokens per step" in layout  # the recipe's global batch is kept
    assert "planner estimate for Test CPU" in out  # the prediction names its device
    assert "step time:" in out


def test_plan_auto_without_a_profile_says_how_to_measure_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(tmp_path / "missing.toml"))
    args = ["train", str(CONFIGS / "tiny-cpu.toml"), "--plan", "auto", "--nproc", "2"]
    assert main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "fivefold calibrate" in err and "--nproc 2" in err and "Traceback" not in err


def test_a_stale_default_profile_is_left_out_with_a_note(tmp_path, monkeypatch, capsys):
    """A profile at the default location that this version cannot read (format 3, written
    before collectives carried their compute gap) does not stop a CPU run nobody pointed at
    it: the run goes on without it and says how to measure again."""
    path = tmp_path / "device-profile.toml"
    path.write_text(
        parse_profile(synthetic()).to_toml().replace(f"format = {FORMAT}", "format = 3")
    )
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(path))
    args = ["train", str(CONFIGS / "tiny-cpu.toml"), "--dry-run", f'train.run_dir="{tmp_path}"']
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "not using the device profile" in captured.err and "format = 3" in captured.err
    assert "fivefold calibrate" in captured.err
    assert "device profile:" not in captured.out


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ('train.global_batch="many"', "train.global_batch = 'many': expected a whole number"),
        ("train.global_batch=-8", "train.global_batch = -8: must be >= 1"),
    ],
)
def test_plan_auto_reads_the_parsed_train_section(profile, override, words, capsys, tmp_path):
    """`--plan auto` takes the batch from the parsed [train] table, not the raw one: a value
    the raw read took for a number (int("many") raised a traceback, -8 went to the search) is
    refused by name, exit 2, before the search."""
    args = ["train", str(CONFIGS / "tiny-cpu.toml"), "--plan", "auto", "--nproc", "1"]
    args += ["--dry-run", f'train.run_dir="{tmp_path}"', override]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err
    assert "--plan auto:" not in captured.out  # refused before the search chose a layout


def test_plan_auto_plans_the_parsed_global_batch(profile, capsys, tmp_path):
    """The recipe's train.global_batch (an override here) is the search's target: 16
    sequences, twice the plan's own 8."""
    args = ["train", str(CONFIGS / "tiny-cpu.toml"), "--plan", "auto", "--nproc", "1"]
    args += ["--dry-run", f'train.run_dir="{tmp_path}"', "train.global_batch=16"]
    assert main(args) == 0
    layout = next(line for line in capsys.readouterr().out.splitlines() if "layout:" in line)
    assert "16 sequences x 128 tokens per step" in layout


def test_a_planner_table_for_other_software_is_noted_once_and_checked(profile, capsys, tmp_path):
    """A run's [planner] table naming another framework's profile plays no part in the run's
    own prediction: one note says so (also under --plan auto, which reads the table's headroom);
    a misspelt field in it is refused by name, exit 2."""
    base = ["train", str(CONFIGS / "tiny-cpu.toml"), "--dry-run", f'train.run_dir="{tmp_path}"']
    assert main([*base, "--plan", "auto", 'planner.profile="torchtitan"']) == 0
    out = capsys.readouterr().out
    assert out.count("note: [planner]") == 1
    assert "this run's predictions model fivefold's own runtime (profile 'fivefold')" in out
    assert main([*base, "planner.headrom=0.2"]) == 2
    assert "planner.headrom" in capsys.readouterr().err
