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
    (
        "plan-needs-more-processes",
        ["plan.tp=2"],
        "this run has 1 process(es), but the plan's degrees multiply to 2",
    ),
    ("unknown-precision", ["plan.precision='fp16'"], "plan.precision = 'fp16': choose one"),
    ("planning-only-precision", ["plan.precision='fp8-mixed'"], "runtime does not implement"),
    ("bad-recompute", ["plan.recompute='some'"], "plan.recompute = 'some': choose one"),
    ("zero-micro-batch", ["plan.micro_batch=0"], "plan.micro_batch = 0: must be a whole number"),
    ("unknown-cluster-preset", ["cluster.preset='dgx-z'"], "cluster.preset = 'dgx-z' is unknown"),
    ("tp-not-dividing-heads", ["--nproc", "3", "plan.tp=3"], "plan.tp = 3 must divide model.heads"),
    ("zero-processes", ["--nproc", "0"], "--nproc 0: the number of processes"),
    ("bad-planner-key", ["planner.bogus=1"], "planner.bogus is not a setting"),
    ("bad-planner-value", ["planner.dropout='yes'"], "planner.dropout = 'yes'"),
    ("zero-planner-bucket", ["planner.dp_bucket_bytes=0"], "a bucket must hold some bytes"),
    ("bad-resume", ["train.resume='sometimes'"], "train.resume = 'sometimes': use \"auto\""),
    ("negative-max-restarts", ["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
    ("resume-and-fresh", ["--resume", "--fresh"], "--resume and --fresh contradict"),
    ("two-recipes", ["configs/small-cpu.toml"], "more than one recipe given"),
    ("shards-not-a-directory", ["data.shards='/nonexistent/shards'"], "is not a directory"),
    ("missing-tokenizer", ["data.tokenizer='/nonexistent/tok.json'"], "does not exist"),
    ("vocab-below-tokenizer", ["model.vocab=1000"], "vocab"),
    # silently accepted, unclear or a traceback before; now refused up front
    ("unknown-section", ["foo.bar=1"], "[foo] is not a recipe section"),
    ("nan-grad-clip", ["train.grad_clip=nan"], "train.grad_clip = nan: expected a finite number"),
    ("nan-min-lr", ["train.min_lr=nan"], "train.min_lr = nan: expected a finite number"),
    ("nan-max-time", ["train.max_time_s=nan"], "train.max_time_s = nan: expected a finite"),
    ("inf-max-time", ["train.max_time_s=inf"], "train.max_time_s = inf: expected a finite"),
    ("nan-weight-decay", ["train.weight_decay=nan"], "train.weight_decay = nan: expected a fin"),
    ("nan-eps", ["train.eps=nan"], "train.eps = nan: expected a finite number"),
    # sliding windows and RoPE scalings a run cannot honour
    (
        "dynamic-rope-with-cp",
        [
            "--nproc",
            "2",
            "plan.cp=2",
            "model.rope_scaling_type='dynamic'",
            "model.rope_scaling_factor=2.0",
            "model.rope_original_seq_len=64",
        ],
        "plan.cp = 2 with model.rope_scaling_type = 'dynamic'",
    ),
    ("bad-sliding-pattern", ["model.sliding_window=8", "model.sliding_pattern='sx'"], "'sx'"),
    ("pattern-without-window", ["model.sliding_pattern='sf'"], "need model.sliding_window > 0"),
    (
        "longrope-not-built",
        ["model.rope_scaling_type='longrope'", "model.rope_scaling_factor=2.0"],
        "model.rope_scaling_type = 'longrope': fivefold's runtime does not implement it",
    ),
    # Muon with a setting it cannot honour
    ("bad-optimizer", ["train.optimizer='lion'"], "train.optimizer = 'lion': choose one of"),
    (
        "muon-with-8bit-states",
        ["train.optimizer='muon'", "plan.optimizer_states='8bit'"],
        "plan.optimizer_states = '8bit' with train.optimizer = 'muon'",
    ),
    (
        "muon-with-offload",
        ["train.optimizer='muon'", "plan.offload='optimizer'"],
        "plan.offload = 'optimizer' with train.optimizer = 'muon'",
    ),
    ("muon-ns-steps", ["train.muon_ns_steps=100"], "train.muon_ns_steps = 100: must be 1 to 99"),
    ("negative-seed", ["train.seed=-1"], "train.seed = -1: must be a whole number >= 0"),
    ("nan-norm-eps", ["model.norm_eps=nan"], "model.norm_eps = nan: expected a finite number"),
    ("negative-rope-theta", ["model.rope_theta=-1"], "model.rope_theta = -1.0: must be positive"),
    ("negative-aux-coef", ["model.router_aux_loss_coef=-1"], "router_aux_loss_coef = -1.0"),
    (
        "tp-not-dividing-kv-heads",
        ["--nproc", "4", "model.hidden=96", "model.heads=12", "model.kv_heads=6", "plan.tp=4"],
        "plan.tp = 4 must divide model.kv_heads = 6",
    ),
    (
        "moe-ep-beyond-its-ranks",
        ["--nproc", "2", "model.preset='tiny-moe'", "plan.tp=2", "plan.ep=4"],
        "plan.ep = 4 must divide dp_shard * cp * tp = 2",
    ),
    ("hidden-1e12", ["model.hidden=1000000000000"], "model.hidden = 1,000,000,000,000 is beyond"),
    ("vocab-1e9", ["model.vocab=1000000000"], "model.vocab = 1,000,000,000 is beyond"),
    ("micro-batch-beyond-limit", ["plan.micro_batch=1000000"], "plan.micro_batch = 1,000,000"),
    (
        "model-beyond-this-machine",
        ["model.vocab=16000000", "model.hidden=1024"],
        "this run does not fit: the planner predicts a peak of",
    ),
    (
        "micro-batch-beyond-this-machine",
        ["plan.micro_batch=131072", "model.seq_len=4096"],
        "lower plan.micro_batch (raise plan.grad_accum to keep the batch)",
    ),
    ("degrees-not-the-processes", ["--nproc", "3", "plan.dp_replicate=2"], "multiply to"),
    # memory levers
    ("offload-all-without-zero3", ["plan.offload='all'"], "set plan.zero = 3"),
    ("offload-all-one-process", ["plan.zero=3", "plan.offload='all'"], "in a single process"),
    (
        "offload-optimizer-with-zero3",
        ["--nproc", "2", "plan.dp_shard=2", "plan.zero=3", "plan.offload='optimizer'"],
        "set plan.offload = 'all', or zero <= 2",
    ),
    ("offload-not-a-string", ["plan.offload=1"], "plan.offload = 1: expected a string"),
    ("unknown-offload", ["plan.offload='gpu'"], "plan.offload = 'gpu': choose one of none"),
    ("unknown-optimizer-states", ["plan.optimizer_states='4bit'"], "choose one of fp32, 8bit"),
    ("fp8-with-fp32", ["plan.fp8='tensorwise'"], "FP8 linear layers run inside a bf16 recipe"),
    (
        "fp8-on-cpu",
        ["plan.fp8='rowwise'", "plan.precision='bf16-mixed'"],
        "plan.fp8 = 'rowwise' on cpu: the CPU has no FP8 arithmetic",
    ),
    (
        "rowwise-fp8-with-tp",
        ["--nproc", "2", "plan.tp=2", "plan.fp8='rowwise'", "plan.precision='bf16-mixed'"],
        "carry one scale per tensor (tensorwise scaling)",
    ),
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


def test_runs_dir_that_is_a_file(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.write_text("not a directory")
    code, err = run_cli(["train", TINY, f"train.runs_dir={str(runs)!r}"], capsys)
    assert code == 2
    assert f"train.runs_dir: {str(runs)!r} is a file, not a directory" in err
    assert_one_paragraph(err)


# `fivefold plan` (the planner): (case id, arguments, expected substring); none may hang
PLAN_CASES = [
    ("gpus-1e12", ["--gpus", "1e12"], "fivefold plans at most 131,072 GPUs"),
    ("hidden-1e12", ["--hidden", "1e12"], "model.hidden = 1,000,000,000,000 is beyond"),
    ("vocab-1e9", ["--vocab", "1e9"], "model.vocab = 1,000,000,000 is beyond"),
    ("batch-tokens-1e18", ["--global-batch-tokens", "1e18"], "at most 1,073,741,824 tokens"),
    ("accumulation-beyond-limit", ["estimate", "--grad-accum", "5000"], "at most 4,096"),
    ("gpus-not-whole-nodes", ["--gpus", "12"], "does not fill whole dgx-h100 nodes"),
    (
        "moe-ep-beyond-dp-shard-cp-tp",
        [
            "estimate",
            "--model",
            "mixtral-8x7b",
            "--gpus",
            "8",
            "--tp",
            "2",
            "--ep",
            "8",
            "--zero",
            "0",
        ],
        "must divide dp_shard * cp * tp",
    ),
    ("fp8-compute", ["--precision", "fp8-mixed"], "computes in fp8"),
    ("unknown-section", ["foo.bar=1"], "[foo] is not a recipe section"),
    ("estimate-layout-not-dividing", ["estimate", "--gpus", "24", "--tp", "8", "--pp", "2"], "16"),
    # memory levers and planner options
    ("fp8-on-a100", ["--cluster", "dgx-a100", "--fp8", "rowwise"], "has no FP8 matrix units"),
    (
        "fp8-on-a100-estimate",
        ["estimate", "--cluster", "dgx-a100", "--fp8", "rowwise", "--zero", "1"],
        "plan.fp8 = 'rowwise' on a100-80gb: it has no FP8 matrix units",
    ),
    ("offload-all-zero1", ["estimate", "--zero", "1", "--offload", "all"], "set plan.zero = 3"),
    ("fp8-with-fp32", ["--fp8", "tensorwise", "--precision", "fp32"], "inside a bf16 recipe"),
    ("unknown-profile", ["--profile", "nope"], "'nope' is not an efficiency profile"),
    ("nan-headroom", ["--headroom", "nan"], "--headroom = nan: must be at least 0"),
    ("bucket-not-a-size", ["--dp-bucket-bytes", "25X"], "'25X' is not a size"),
    ("nan-fragmentation", ["--fragmentation-fraction", "nan"], "--fragmentation-fraction = nan"),
    ("zero-bucket", ["--collective-granularity", "bucket", "--dp-bucket-bytes", "0"], "at least 1"),
    ("estimate-with-risk", ["estimate", "--zero", "1", "--risk", "expected"], "--risk: only a"),
]


@pytest.mark.parametrize(("case", "args", "expected"), PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_input_exits_2_at_once(case, args, expected, tmp_path, capsys):
    import time

    model = [] if "--model" in args else ["--model", "llama3-8b"]
    start = time.perf_counter()
    out = [] if "estimate" in args else ["--out", str(tmp_path / "p.toml")]  # a search's flag
    code, err = run_cli(["plan", *model, *args, *out], capsys)
    assert code == 2, err
    assert time.perf_counter() - start < 10  # refused at once, never searched
    assert expected in err and err.startswith("fivefold plan: error: ")
    assert "Traceback" not in err


def test_plan_estimate_refuses_search_flags_rather_than_ignoring_them(tmp_path, capsys):
    out = tmp_path / "e.toml"
    args = ["plan", "estimate", "--model", "tiny", "--gpus", "1", "--top", "3", "--out", str(out)]
    code, err = run_cli(args, capsys)
    assert code == 2
    assert "--top, --out: only a search uses them" in err
    assert not out.exists()


def test_plan_out_into_a_missing_directory_is_refused_before_searching(tmp_path, capsys):
    out = tmp_path / "missing" / "p.toml"
    code, err = run_cli(["plan", "--model", "tiny", "--gpus", "1", "--out", str(out)], capsys)
    assert code == 2
    assert f"the directory {str(out.parent)!r} does not exist" in err
    assert not out.parent.exists()


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


def test_typos_come_with_the_closest_name_and_every_other_problem(tmp_path, capsys):
    """A typo in an override, a section and a preset beside a layout that needs more processes:
    one error lists all of them, each misspelling with the name it most likely meant."""
    code, err = run_cli(
        ["train", TINY, "plan.tp=2", "train.setps=100", "trian.x=1", "model.preset='tinny'"],
        capsys,
    )
    assert code == 2
    assert_one_paragraph(err)
    assert err.startswith("fivefold train: error: 5 problems in the configuration:")
    assert "train.setps is not a setting; did you mean train.steps?" in err
    assert "[trian] is not a recipe section" in err and "did you mean [train]?" in err
    assert "model.preset = 'tinny' is unknown; did you mean 'tiny'?" in err
    assert "the plan's degrees multiply to 2" in err and "start it with --nproc 2" in err


def test_an_unknown_field_with_nothing_close_lists_the_known_ones(capsys):
    code, err = run_cli(["train", TINY, "plan.zzzzzz=1"], capsys)
    assert code == 2
    assert "did you mean" not in err
    assert "plan.zzzzzz is not a setting; known plan fields: " in err and "micro_batch" in err


def test_nproc_without_a_layout_names_the_data_parallel_degrees(capsys):
    """On CPU with no cluster the "GPUs" are the processes: the message says so and names the
    degrees that spread the run over them, not "change a degree" for a 2-GPU cluster."""
    assert main(["train", "--nproc", "2", TINY, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "this run has 2 process(es), but the plan's degrees multiply to 1" in err
    assert "plan.dp_replicate=2" in err and "plan.dp_shard=2 plan.zero=3" in err
    assert "GPUs" not in err and "change a degree" not in err
    assert main(["train", "--nproc", "4", TINY, "plan.tp=2", "--dry-run"]) == 2
    expected = "multiply to 2 (pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2): start it with"
    assert expected in capsys.readouterr().err
