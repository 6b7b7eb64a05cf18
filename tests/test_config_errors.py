"""User mistakes through the real CLI entry: exit status 2 and one paragraph naming the fix.

Each case runs `fivefold train` (via `fivefold.cli.main.main`) on the tiny CPU recipe with one
mistake, and checks the message names the field (or file) at fault; never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fivefold.cli.main import main

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml")

# (case id, arguments after the recipe, expected substring of the message)
CASES = [
    ("unknown-model-preset", ["model.preset='gpt9'"], "model.preset = 'gpt9' is unknown"),
    ("unknown-model-field", ["model.widht=3"], "model.widht is not a setting"),
    ("model-field-type", ["model.layers='two'"], "model.layers = 'two': expected a whole number"),
    ("kv-heads-not-dividing", ["model.kv_heads=3"], "model.kv_heads = 3 must divide"),
    ("override-without-section", ["steps=3"], "write it as section.field=value"),
    ("negative-lr", ["train.lr=-1"], "train.lr = -1.0: the learning rate must be a positive"),
    ("warmup-exceeds-steps", ["train.steps=5"], "train.warmup_steps = 10 exceeds train.steps = 5"),
    ("min-lr-above-lr", ["train.min_lr=1.0"], "train.min_lr = 1.0: must be between 0"),
    ("zero-steps", ["train.steps=0", "train.warmup_steps=0"], "train.steps = 0: must be at least"),
    ("unknown-train-field", ["train.stepz=3"], "train.stepz is not a setting"),
    ("bad-lr-schedule", ["train.lr_schedule='step'"], "train.lr_schedule = 'step': choose one"),
    ("bad-betas", ["train.betas=[0.9]"], "train.betas = [0.9]: write two numbers"),
    ("negative-grad-clip", ["train.grad_clip=-1"], "train.grad_clip = -1.0: must be >= 0"),
    ("bad-device", ["train.device='tpu'"], "train.device = 'tpu': choose one of"),
    ("global-batch-mismatch", ["train.global_batch=12"], "set plan.grad_accum = 3"),
    ("eval-without-held-out", ["train.eval_every=5", "data.val_fraction=0"], "needs held-out"),
    ("plan-needs-more-processes", ["plan.tp=2"], "plan degrees multiply to"),
    ("unknown-precision", ["plan.precision='fp16'"], "plan.precision = 'fp16': choose one"),
    ("planning-only-precision", ["plan.precision='fp8-mixed'"], "planning recipe"),
    ("bad-recompute", ["plan.recompute='some'"], "plan.recompute = 'some': choose one"),
    ("zero-micro-batch", ["plan.micro_batch=0"], "plan.micro_batch = 0: must be a whole number"),
    ("unknown-cluster-preset", ["cluster.preset='dgx-z'"], "cluster.preset = 'dgx-z' is unknown"),
    ("tp-not-dividing-heads", ["--nproc", "3", "plan.tp=3"], "plan.tp = 3 must divide model.heads"),
    ("zero-processes", ["--nproc", "0"], "--nproc 0: the number of processes"),
    (
        "compile-with-tp",
        ["--nproc", "2", "plan.tp=2", "train.compile=true"],
        "train.compile = true with plan.tp = 2",
    ),
    ("bad-resume", ["train.resume='sometimes'"], "train.resume = 'sometimes': use \"auto\""),
    ("negative-max-restarts", ["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
    ("resume-and-fresh", ["--resume", "--fresh"], "--resume and --fresh contradict"),
    ("two-recipes", ["configs/small-cpu.toml"], "more than one recipe given"),
    ("shards-not-a-directory", ["data.shards='/nonexistent/shards'"], "is not a directory"),
    ("missing-tokenizer", ["data.tokenizer='/nonexistent/tok.json'"], "does not exist"),
    ("vocab-below-tokenizer", ["model.vocab=1000"], "vocab"),
]


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


def assert_one_paragraph(err: str) -> None:
    assert err.startswith("fivefold train: error: ")
    assert "Traceback" not in err
    assert "\n\n" not in err.strip()


@pytest.mark.parametrize(("case", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_config_exits_2_with_message(case, args, expected, tmp_path, capsys):
    extra = [f"train.runs_dir={str(tmp_path)!r}", "train.progress=false"]
    code, err = run_cli(["train", TINY, *extra, *args], capsys)
    assert code == 2, err
    assert expected in err
    assert_one_paragraph(err)


def test_missing_recipe_file(capsys):
    code, err = run_cli(["train", "configs/no-such-recipe.toml"], capsys)
    assert code == 2
    assert "recipe file 'configs/no-such-recipe.toml' does not exist" in err
    assert_one_paragraph(err)


def test_recipe_that_is_not_toml(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npreset = 'tiny'\n")
    code, err = run_cli(["train", str(bad)], capsys)
    assert code == 2
    assert "is not valid TOML" in err
    assert_one_paragraph(err)


def test_section_that_is_not_a_table(tmp_path, capsys):
    bad = tmp_path / "flat.toml"
    bad.write_text("train = 3\n")
    code, err = run_cli(["train", str(bad)], capsys)
    assert code == 2
    assert "train = 3 is not a section" in err
    assert_one_paragraph(err)


def test_resume_with_a_different_model(tmp_path, capsys):
    common = [
        "train",
        TINY,
        f"train.runs_dir={str(tmp_path)!r}",
        "--steps",
        "1",
        "train.warmup_steps=1",
        "--no-progress",
    ]
    assert main(common) == 0
    capsys.readouterr()
    code, err = run_cli([*common, "--resume", "model.layers=3"], capsys)
    assert code == 2
    assert "holds a different model: model.layers = 3 (checkpoint: 2)" in err
    assert_one_paragraph(err)


def test_many_problems_are_reported_at_once(tmp_path, capsys):
    code, err = run_cli(
        ["train", TINY, "train.lr=-1", "train.stepz=1", "train.device='tpu'"], capsys
    )
    assert code == 2
    assert err.startswith("fivefold train: error: 3 problems in the configuration:")
    for field in ("train.lr", "train.stepz", "train.device"):
        assert field in err
