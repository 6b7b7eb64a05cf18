"""`fivefold tune` on CPU: the tiny preset under a small memory limit.

The choice must be the largest micro-batch whose measured peak fits, with the cheapest
recompute policy reaching it, judged against the measured numbers themselves.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fivefold.cli.cmd_tune import GIB, POLICIES, Trial, choose, nothing_fits, tune_policy
from fivefold.cli.main import main
from fivefold.train.entry import load_run

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
LIMIT_GIB = 0.062  # between the tiny preset's micro-batch 4 and 8 without recompute


def test_choice_is_the_largest_measured_fit():
    limit = int(LIMIT_GIB * GIB)
    trials = [t for p in ("none", "full") for t in tune_policy(str(TINY), [], p, limit, 16)]
    for policy in ("none", "full"):
        mine = [t for t in trials if t.policy == policy]
        assert [t.micro_batch for t in mine] == [2**i for i in range(len(mine))]
        assert all(t.fits == (t.measured <= limit) for t in mine)
        assert all(t.fits for t in mine[:-1]) and not mine[-1].fits  # stops at the first miss
        peaks = [t.measured for t in mine]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)  # grows with the batch
        for t in mine:  # the planner's prediction printed beside it, within 10%
            assert t.predicted == pytest.approx(t.measured, rel=0.10)
    # Full recompute keeps only block inputs: at equal micro-batch it needs less memory.
    none = {t.micro_batch: t.measured for t in trials if t.policy == "none"}
    full = {t.micro_batch: t.measured for t in trials if t.policy == "full"}
    assert all(full[mb] < none[mb] for mb in none.keys() & full.keys() if mb > 1)
    fitting = [t for t in trials if t.fits]
    largest = max(t.micro_batch for t in fitting)
    cheapest = min((t.policy for t in fitting if t.micro_batch == largest), key=POLICIES.index)
    choice = choose(trials)
    assert (choice.micro_batch, choice.policy) == (largest, cheapest)
    assert choice.measured <= limit
    # and the next micro-batch of that policy did not fit
    after = [t for t in trials if t.policy == cheapest and t.micro_batch == 2 * largest]
    assert after and after[0].measured > limit


def test_write_updates_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "tiny.toml"
    shutil.copy(TINY, recipe)
    before = recipe.read_text()
    code = main(
        [
            "tune",
            str(recipe),
            "--memory-limit",
            str(LIMIT_GIB),
            "--policies",
            "none,full",
            "--max-micro-batch",
            "8",
            "--write",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    choice_line = next(line for line in out.splitlines() if line.startswith("choice:"))
    plan = load_run(recipe, [], world_size=1).recipe.plan
    assert f"plan.micro_batch = {plan.micro_batch}," in choice_line
    assert f"plan.recompute = {plan.recompute!r}" in choice_line
    # Only the two values changed: every other line (comments too) is kept.
    changed = [
        (a, b)
        for a, b in zip(before.splitlines(), recipe.read_text().splitlines(), strict=True)
        if a != b
    ]
    assert 1 <= len(changed) <= 2
    assert all(a.split("=")[0] == b.split("=")[0] for a, b in changed)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "--memory-limit is required on CPU"),
        (["--memory-limit", "1", "--policies", "none,some"], "--policies"),
        (["plan.tp=2", "--memory-limit", "1"], "fivefold tune runs one process"),
    ],
)
def test_bad_arguments_exit_2(capsys, args, words):
    assert main(["tune", str(TINY), *args]) == 2
    assert words in capsys.readouterr().err


def test_nothing_fits_names_the_limit_to_raise_and_the_policies_left():
    trials = [Trial("none", 1, 3 * GIB, None, False), Trial("selective", 1, GIB + 1, None, False)]
    text = nothing_fits(trials, GIB)
    # least peak 1 GiB + 1 byte = 1.000000001 GiB, rounded up to the next 0.001 GiB
    assert "its least measured peak is 1.000 GiB (recompute 'selective')" in text
    assert "Raise --memory-limit to at least 1.001" in text
    assert "try recompute full (--policies full)" in text
    oom = nothing_fits([Trial("none", 1, None, None, False)], None)
    assert "out of GPU memory under recompute none" in oom
    assert "try recompute selective or full (--policies selective,full)" in oom
    assert "recompute" not in nothing_fits([Trial("full", 1, GIB, None, False)], 1).split(")")[1]


def test_nothing_fits_exits_2_with_the_measured_peak(capsys):
    assert main(["tune", str(TINY), "--memory-limit", "0.001", "--policies", "none"]) == 2
    err = capsys.readouterr().err
    assert "--memory-limit 0.001: nothing fits, not even micro-batch 1" in err
    peak = float(err.split("least measured peak is ")[1].split(" GiB")[0])
    assert peak > 0.001  # the tiny preset's micro-batch 1 (cf. LIMIT_GIB, which fits 4)
    assert "Raise --memory-limit to at least" in err and "--policies selective,full" in err
