"""The recipes fivefold writes run as they say: `plan --out` writes [train] and [data] (so
`launch --slurm` takes it), `launch --slurm` derives its time limit from the prediction, and a
recipe's batch is the same to `plan estimate` and to `fivefold train`."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from fivefold.cli.main import main
from fivefold.cli.recipe_text import TRAIN_FIELDS
from fivefold.planner.estimate import estimate
from fivefold.specs import load_recipe
from fivefold.train.config import TrainConfig
from fivefold.train.entry import check_layout, load_run
from fivefold.train.job_time import TIME_EXTRA_S, TIME_MARGIN

PLAN = ["plan", "--model", "vizz-7b", "--cluster", "dgx-h100", "--gpus", "16", "--seq", "8K"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "recipe.toml"
    assert main([*PLAN, "--global-batch-tokens", "1M", "--out", str(path)]) == 0
    return path


def test_plan_out_writes_every_section_with_its_defaults(planned):
    data = tomllib.loads(planned.read_text())
    assert set(data) == {"model", "cluster", "plan", "planner", "train", "data"}
    assert set(data["train"]) == set(TRAIN_FIELDS)
    defaults = TrainConfig()
    assert data["train"]["name"] == "vizz-7b"
    for key in TRAIN_FIELDS[1:]:
        assert data["train"][key] == getattr(defaults, key), key
    text = planned.read_text()
    assert "steps = 100  # default: optimizer steps" in text  # each default says it is one
    assert "as written, the run trains on the embedded corpus" in text
    # It loads and validates as a 16-rank training run (not on this machine).
    run = check_layout(planned, [], 16, local=False)
    assert run.recipe.plan == load_recipe(planned).plan and run.train.steps == 100


def test_launch_slurm_takes_plans_recipe_and_times_it_by_the_prediction(planned, capsys):
    assert main(["launch", "--slurm", str(planned), "train.steps=20000"]) == 0
    captured = capsys.readouterr()
    recipe = load_recipe(planned)
    step_s = estimate(recipe.model, recipe.cluster, recipe.plan).step_time_s
    minutes = math.ceil((20000 * step_s * TIME_MARGIN + TIME_EXTRA_S) / 60)
    days, rest = divmod(minutes, 1440)
    limit = f"{rest // 60:02d}:{rest % 60:02d}:00"
    limit = f"{days}-{limit}" if days else limit
    assert f"#SBATCH --time={limit}\n" in captured.out
    assert f"20,000 steps x {step_s:.3f} s predicted" in captured.err
    assert ("longer than most partitions allow" in captured.err) is (days >= 7)
    steps = math.ceil(8 * 86400 / step_s)  # eight days: said to be too long for most queues
    assert main(["launch", "--slurm", str(planned), f"train.steps={steps}"]) == 0
    assert "longer than most partitions allow" in capsys.readouterr().err
    # A limit given by hand (a partition's) is kept; a run longer than it becomes a chain of
    # jobs, each as many steps as fit the limit, each stopping with a checkpoint at its share.
    assert main(["launch", "--slurm", "--time", "02:00:00", str(planned), "train.steps=20000"]) == 0
    captured = capsys.readouterr()
    per_job = math.floor((2 * 3600 - TIME_EXTRA_S) / (step_s * TIME_MARGIN))
    jobs = math.ceil(20000 / per_job)
    assert "#SBATCH --time=02:00:00\n" in captured.out
    assert f"#SBATCH --array=1-{jobs}%1\n" in captured.out
    assert f'"train.stop_at=$((SLURM_ARRAY_TASK_ID * {per_job}))"\n' in captured.out
    assert f"{jobs} chained jobs of up to {per_job:,} steps" in captured.err
    # A run that fits its limit stays one job.
    assert main(["launch", "--slurm", "--time", "2-00:00:00", str(planned), "train.steps=200"]) == 0
    assert "--array" not in capsys.readouterr().out
    # Not one step fits: said, with the least limit that fits one.
    assert main(["launch", "--slurm", "--time", "00:30:00", str(planned), "train.steps=200"]) == 2
    assert "--time 00:30:00: too short for one step" in capsys.readouterr().err


def test_plan_out_with_a_token_budget_writes_its_steps_and_checkpoints(tmp_path, capsys):
    """`--tokens` sets the recipe's steps (tokens over the plan's tokens per step), Young's
    checkpoint interval and the checkpoints kept, the figures `plan` printed."""
    from fivefold.planner.budget.token_budget import (
        KEEP_CHECKPOINTS,
        budget_inputs,
        checkpoint_bytes,
        interval_steps,
    )

    path = tmp_path / "budget.toml"
    flags = [*PLAN, "--global-batch-tokens", "1M", "--tokens", "50B", "--out", str(path)]
    assert main(flags) == 0
    printed = capsys.readouterr().out
    recipe = load_recipe(path)
    train = tomllib.loads(path.read_text())["train"]
    tokens_per_step = recipe.plan.global_batch * recipe.model.seq_len
    assert train["steps"] == math.ceil(50e9 / tokens_per_step)
    step_s = estimate(recipe.model, recipe.cluster, recipe.plan).step_time_s
    rate = budget_inputs({"tokens": 50e9}, {}).failure_rate
    k, _, _ = interval_steps(recipe.model, recipe.cluster, recipe.plan, step_s, rate)
    assert train["ckpt_every"] == k > 0
    assert train["keep_checkpoints"] == KEEP_CHECKPOINTS == TrainConfig().keep_checkpoints
    # the storage the run needs at its peak: the kept checkpoints and the one being written
    size_gb = checkpoint_bytes(recipe.model, recipe.plan) / 1e9
    assert f"{(KEEP_CHECKPOINTS + 1) * size_gb:,.1f} GB of storage" in printed
    assert f"= {train['steps']:,} steps" in printed and f"every {k:,} steps" in printed
    run = check_layout(path, [], 16, local=False)
    assert (run.train.steps, run.train.ckpt_every) == (train["steps"], k)


def test_a_recipes_batch_is_the_same_to_plan_estimate_and_to_train(tmp_path, capsys):
    """micro_batch 4 and no grad_accum: `train` runs accum 1; `plan estimate` planned 4,096."""
    path = tmp_path / "r.toml"
    path.write_text('[model]\npreset = "tiny"\n\n[plan]\nmicro_batch = 4\n')
    assert main(["plan", "estimate", str(path), "--gpus", "1", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["plan"]
    trained = load_run(path, [], world_size=1).recipe.plan
    assert (planned["micro_batch"], planned["grad_accum"]) == (4, trained.grad_accum) == (4, 1)
    # Flags still set the batch when the command has no recipe, or when asked.
    flags = ["--gpus", "1", "--global-batch", "16", "--json"]
    assert main(["plan", "estimate", str(path), *flags]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["grad_accum"] == 4


def test_train_flags_and_auto_plan_write_toml_through_the_one_writer():
    """`--name` with quotes and backslashes reaches [train] as typed (once written between bare
    quotes, it broke the override); plan values from `--plan auto` are written the same way."""
    import argparse

    from fivefold.cli.cmd_train import _flag_overrides, add_arguments
    from fivefold.specs.recipe import parse_overrides

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    name = 'run "A" \\ 2'
    args = parser.parse_args(["recipe.toml", "--name", name])
    assert parse_overrides(_flag_overrides(args))["train"]["name"] == name


def test_launch_slurm_reads_the_gpus_per_node_the_recipe_rules_give(capsys):
    """A [cluster] of 4 GPUs without gpus_per_node is one node of 4 (the recipe rules: whole
    nodes of up to 8): the job asks for 1 node x 4 GPUs, as the plan's 4 ranks need (the raw
    read took 8 per node and refused the recipe's own layout); a mistyped value is named."""
    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml")
    four = [
        recipe,
        'cluster.gpu="h100"',
        "cluster.gpus=4",
        "plan.dp_replicate=4",
        "plan.grad_accum=1",
        "plan.micro_batch=2",
    ]
    assert main(["launch", "--slurm", *four]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --gpus-per-node=4\n" in script
    assert main(["launch", "--slurm", *four, 'cluster.gpus_per_node="four"']) == 2
    assert "cluster.gpus_per_node = 'four'" in capsys.readouterr().err
