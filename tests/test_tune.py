"""`fivefold tune` on CPU: the tiny preset under a small memory limit.

The choice must be the largest micro-batch whose measured peak fits, with the cheapest
recompute policy reaching it, judged against the measured numbers themselves.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.train import tune
from fivefold.train.entry import load_run
from fivefold.train.tune import (
    GIB,
    POLICIES,
    Trial,
    TuneSession,
    choose,
    load_trial_run,
    nothing_fits,
    tune_policy,
)

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
LIMIT_GIB = 0.062  # between the tiny preset's micro-batch 4 and 8 without recompute


def test_choice_is_the_largest_measured_fit():
    limit = int(LIMIT_GIB * GIB)
    session = TuneSession(str(TINY), [], load_trial_run(str(TINY), [], 1, "none"))
    trials = [t for p in ("none", "full") for t in tune_policy(session, p, limit, 16)]
    for policy in ("none", "full"):
        mine = [t for t in trials if t.policy == policy]
        assert [t.micro_batch for t in mine] == [2**i for i in range(len(mine))]
        assert all(t.fits == (t.peak_bytes <= limit) for t in mine)
        assert all(t.fits for t in mine[:-1]) and not mine[-1].fits  # stops at the first miss
        peaks = [t.peak_bytes for t in mine]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)  # grows with the batch
        for t in mine:  # the planner's prediction printed beside it, within 10%
            assert t.predicted == pytest.approx(t.peak_bytes, rel=0.10)
    # Full recompute keeps only block inputs: at equal micro-batch it needs less memory.
    none = {t.micro_batch: t.peak_bytes for t in trials if t.policy == "none"}
    full = {t.micro_batch: t.peak_bytes for t in trials if t.policy == "full"}
    assert all(full[mb] < none[mb] for mb in none.keys() & full.keys() if mb > 1)
    fitting = [t for t in trials if t.fits]
    largest = max(t.micro_batch for t in fitting)
    cheapest = min((t.policy for t in fitting if t.micro_batch == largest), key=POLICIES.index)
    choice = choose(trials)
    assert (choice.micro_batch, choice.policy) == (largest, cheapest)
    assert choice.peak_bytes <= limit
    # and the next micro-batch of that policy did not fit
    after = [t for t in trials if t.policy == cheapest and t.micro_batch == 2 * largest]
    assert after and after[0].peak_bytes > limit


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


def test_each_trial_is_printed_as_it_ends_and_the_model_and_data_are_built_once(
    capsys, monkeypatch
):
    import fivefold.model as model_pkg
    import fivefold.train.inputs as inputs

    built = {"model": 0, "data": 0}
    build_model, load_train_data = model_pkg.build_model, inputs.load_train_data

    def counted_model(*a, **k):
        built["model"] += 1
        return build_model(*a, **k)

    def counted_data(*a, **k):
        built["data"] += 1
        return load_train_data(*a, **k)

    monkeypatch.setattr(model_pkg, "build_model", counted_model)
    monkeypatch.setattr(inputs, "load_train_data", counted_data)
    printed: list[str] = []  # what stdout held when each trial started
    second_step_peak = tune.second_step_peak

    def spy(session, run):
        printed.append(capsys.readouterr().out)
        return second_step_peak(session, run)

    monkeypatch.setattr(tune, "second_step_peak", spy)
    args = ["tune", str(TINY), "--memory-limit", "1", "--policies", "none,full"]
    assert main([*args, "--max-micro-batch", "2"]) == 0
    printed.append(capsys.readouterr().out)
    assert len(printed) == 5  # four trials (none 1, 2; full 1, 2), then the rest
    so_far = ""
    for i, (policy, micro_batch) in enumerate([("none", 1), ("none", 2), ("full", 1), ("full", 2)]):
        so_far += printed[i + 1]
        rows = [line.split() for line in so_far.splitlines()]
        # the trial that just ended is on stdout before the next one starts
        assert [policy, str(micro_batch)] in [r[:2] for r in rows], so_far
    assert "tune: building the model and data once on cpu" in printed[0]
    assert built == {"model": 1, "data": 1}


def test_remove_recompute_restores_the_plain_forward():
    from fivefold.model import build_model
    from fivefold.parallel.activation_checkpoint import apply_recompute, remove_recompute

    run = load_trial_run(str(TINY), [], 1, "none")
    model = build_model(run.recipe.model)
    blocks = len(model.layers)
    assert apply_recompute(model, "selective") == blocks
    assert remove_recompute(model) == blocks
    assert apply_recompute(model, "full") == blocks  # re-wrapped: the flag was cleared
    assert all("forward" in vars(b) for b in model.layers.values())
    assert remove_recompute(model) == blocks
    assert not any("forward" in vars(m) for m in model.modules())
