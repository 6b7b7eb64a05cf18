"""Process entry of a training run: `python -m fivefold.train recipe.toml [section.field=value...]`.

The same entry serves one process and every rank under torchrun (`torchrun --nproc-per-node 4
-m fivefold.train recipe.toml`): `make_runtime` picks the runtime from the environment. The CLI
command `fivefold train` calls `load_run` and `train` from here too, so both read recipes the
same way: on a machine (or `train.device`) without CUDA, or on a GPU without native bf16, a
recipe that does not name `plan.precision` trains in fp32; a recipe without a [cluster] runs on
the GPU it finds (`fivefold.parallel.device`) or, on a CPU, uses the device profile at the
default location (`fivefold.specs.profile.default_profile_path`) when one exists there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError, FivefoldError, WorldSizeProblem
from fivefold.launch.rank_report import RankReport, attempt, mark_attempt, write_report
from fivefold.launch.shielded_import import signals_held
from fivefold.parallel.device import local_cluster_table, local_gpu, uses_cuda
from fivefold.parallel.mesh import ParallelDims
from fivefold.specs.profile import default_profile_path, load_profile
from fivefold.specs.recipe import merge, parse_overrides, read_toml, recipe_from_dict
from fivefold.train.config import (
    RunConfig,
    parse_train_config,
    section_problems,
    train_device,
)
from fivefold.train.prestart import prestart_problems

# torch loads lazily: `fivefold --help` imports this module (cli/cmd_train.py), and under
# `python -m fivefold.train` signals are held until `main` imports the loop; so torch,
# model.torch_features, train.optim and train.start are imported inside their functions.

RECIPE_SUFFIXES = (".toml",)
RESUME_HELP = (
    "continue from the newest valid checkpoint in <run_dir>/ckpt, and say so when there is none "
    '(train.resume=true). The default, train.resume="auto", already resumes when one exists'
)
FRESH_HELP = (
    "start over at step 0, deleting the run's earlier checkpoints (train.resume=false); without "
    "it a re-run continues from the newest valid checkpoint"
)


def split_recipe_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """`["a.toml", "train.lr=1e-3"]` -> ("a.toml", ["train.lr=1e-3"]); at most one recipe path."""
    paths = [item for item in items if "=" not in item]
    overrides = [item for item in items if "=" in item]
    if len(paths) > 1:
        raise ConfigError(
            f"more than one recipe given ({', '.join(paths)}); name one recipe file and write "
            "changes as section.field=value overrides (e.g. train.steps=100)."
        )
    return (paths[0] if paths else None), overrides


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _trains_on_cpu(data: dict[str, dict[str, Any]]) -> bool:
    return not uses_cuda(train_device(data))


def _native_bf16(data: dict[str, dict[str, Any]]) -> bool:
    """Whether this run's device computes bf16 natively (a GPU from Ampere on)."""
    if _trains_on_cpu(data):
        return False
    gpu = local_gpu()
    return gpu is not None and gpu.bf16


def recipe_data(recipe_path: str | Path | None, overrides: list[str]) -> dict[str, dict[str, Any]]:
    """The recipe file merged with overrides, with the CPU precision default applied."""
    data = read_toml(recipe_path) if recipe_path else {}
    flat = [f"{name} = {value!r}" for name, value in data.items() if not isinstance(value, dict)]
    if flat:
        raise ConfigError(
            f"recipe {str(recipe_path)!r}: {', '.join(flat)} is not a section; write settings "
            "under a table header such as [train] (e.g. [train] then steps = 100)."
        )
    data = merge(data, parse_overrides(overrides))
    plan = data.get("plan", {})
    if isinstance(plan, dict) and "precision" not in plan and not _native_bf16(data):
        data = merge(data, {"plan": {"precision": "fp32"}})
    return data


def with_default_profile(
    data: dict[str, dict[str, Any]], world: int | None = None
) -> dict[str, dict[str, Any]]:
    """A run without a [cluster] is planned for the machine it runs on. On a GPU: the cluster
    the device describes (`fivefold.parallel.device.local_cluster_table`, `world` processes,
    default the torchrun world). On a CPU: the calibrated profile at the default location; one
    this fivefold cannot read (written by an older version, or damaged) is left out with a note
    on stderr saying how to measure again: the user did not name it, so it must not stop the
    run (a profile named in the recipe or with --cluster still does)."""
    if "cluster" in data:
        return data
    if not _trains_on_cpu(data):
        return merge(data, {"cluster": local_cluster_table(world or world_size_from_env())})
    path = default_profile_path()
    if not path.is_file():
        return data
    try:
        if load_profile(path).kind != "cpu":  # `fivefold calibrate` on a GPU measured that
            return data
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"note: not using the device profile {str(path)!r} ({err.problems[0]}); "
                "`fivefold calibrate` measures this machine again.",
                file=sys.stderr,
            )
        return data
    return merge(data, {"cluster": {"profile": str(path)}})


def load_run(
    recipe_path: str | Path | None, overrides: list[str], world_size: int | None = None
) -> RunConfig:
    """Read, override and validate a recipe and its [train]/[data] sections (ConfigError)."""
    world = world_size or world_size_from_env()
    data = recipe_data(recipe_path, overrides)
    named_cluster = "cluster" in data
    try:
        recipe = recipe_from_dict(with_default_profile(data, world), world)
    except ConfigError as err:
        problems = list(err.problems)
        if not named_cluster and any(isinstance(p, WorldSizeProblem) for p in problems):
            # no cluster named: the "GPUs" are this run's processes; say it in those words
            problems = [p for p in problems if not isinstance(p, WorldSizeProblem)]
            problems.insert(0, _process_count_problem(data.get("plan", {}), world))
        problems += section_problems(data)  # the [train]/[data] mistakes too, all at once
        raise ConfigError(problems) from None
    if recipe.model.runtime_problems():  # `fivefold plan` plans these; a run cannot build them
        raise ConfigError(recipe.model.runtime_problems())
    return parse_train_config(recipe)


def _process_count_problem(plan: Any, world: int) -> WorldSizeProblem:
    """The plan's degrees against this run's `world` processes, and the overrides that match."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    degrees = {n: plan.get(n, 1) if isinstance(plan, dict) else 1 for n in names}
    product = 1
    for value in degrees.values():
        product *= value if isinstance(value, int) else 1
    text = " x ".join(f"{n} {v}" for n, v in degrees.items())
    fix = f"start it with --nproc {product}, or change the degrees"
    if product == 1:
        fix = (
            f"to train data-parallel on them add plan.dp_replicate={world} (each process a "
            f"full copy) or plan.dp_shard={world} plan.zero=3 (FSDP), let --plan auto choose "
            "a layout, or start it with --nproc 1"
        )
    return WorldSizeProblem(
        f"this run has {world} process(es), but the plan's degrees multiply to {product} "
        f"({text}): {fix}."
    )


def check_layout(
    recipe_path: str | Path | None, overrides: list[str], world_size: int, local: bool = True
) -> RunConfig:
    """`load_run` for `world_size` processes, and the plan's degrees must multiply to it: what
    the launchers call before starting anything (ConfigError otherwise), and this torch must
    have the APIs the recipe needs (`fivefold.model.torch_features`). With `local`, the run
    is on this machine: the paths it names must be there, its predicted memory must fit what
    the machine has free (`fivefold.train.prestart`) and its device must run the plan's memory
    levers (`fivefold.train.optim.lever_problems`); every problem in one error."""
    from fivefold.model.torch_features import torch_problems

    run = load_run(recipe_path, overrides, world_size=world_size)
    ParallelDims.from_plan(run.recipe.plan, world_size)
    problems = torch_problems(run.recipe.model, run.recipe.plan)  # this torch's APIs
    if local:
        problems += local_problems(run, world_size)
    if problems:
        raise ConfigError(problems)
    return run


def local_problems(run: RunConfig, world_size: int) -> list[str]:
    """Why `run` cannot start on this machine with `world_size` local processes: paths, the
    checkpoint, memory (`fivefold.train.prestart`) and the plan's memory levers."""
    from fivefold.train.optim import lever_problems

    device = local_device(run.train.device)
    problems = prestart_problems(run, world_size, cuda=device.type == "cuda")
    return problems + lever_problems(run.recipe.plan, device)


def local_device(name: str):
    """The device `train.device` names on this machine (first GPU for "cuda"), no side effects."""
    import torch

    return torch.device("cuda", 0) if uses_cuda(name) else torch.device("cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fivefold.train",
        description="Run one training process (or one rank under torchrun) from a TOML recipe. "
        'By default (train.resume="auto") a run whose directory holds a valid checkpoint '
        "continues from the newest one; a run already at train.steps prints that it is complete "
        "and exits 0. After an elastic restart (torchrun --max-restarts) it always resumes.",
    )
    parser.add_argument(
        "items",
        nargs="*",
        metavar="RECIPE|OVERRIDE",
        help="a recipe file (configs/*.toml) and section.field=value overrides",
    )
    parser.add_argument("--resume", action="store_true", help=RESUME_HELP)
    parser.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    return parser


def resume_overrides(resume: bool, fresh: bool) -> list[str]:
    """The `train.resume` override of the --resume / --fresh flags (ConfigError for both)."""
    if resume and fresh:
        raise ConfigError(
            "--resume and --fresh contradict each other: give --resume to continue the run from "
            "its newest checkpoint, or --fresh to start over at step 0."
        )
    if resume:
        return ["train.resume=true"]
    return ["train.resume=false"] if fresh else []


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit status: 0, 2 after a user error, 128 + signal when interrupted.
    Under `fivefold train --nproc N` the message goes to the launcher, which prints it once
    (`fivefold.launch.rank_report`); otherwise this process prints it."""
    args = build_parser().parse_args(argv)
    try:
        mark_attempt()
        with signals_held():  # a signal since the process started is acted on here
            from fivefold.train.start import train

        recipe_path, overrides = split_recipe_and_overrides(args.items)
        overrides += resume_overrides(args.resume, args.fresh)
        world = world_size_from_env()  # a single process checks its machine; launchers did
        summary = train(check_layout(recipe_path, overrides, world, local=world == 1))
    except FivefoldError as err:
        return _report("error", f"{err}", err.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted", "stopped at once by a repeated interrupt; no checkpoint", 130)
    if summary.exit_code:
        return _report(
            "interrupted", f"interrupted after step {summary.end_step}", summary.exit_code
        )
    if attempt() > 0 and int(os.environ.get("RANK", "0")) == 0:  # after a restart: say where
        _report("resumed", _resumed(summary), 0)
    return 0


def _resumed(summary: Any) -> str:
    """'resumed from step M and completed step N' (or where and why it stopped), from a
    `TrainSummary`."""
    text = f"resumed from step {summary.start_step} and "
    if summary.stop_reason in ("completed", "already_complete"):
        return text + f"completed step {summary.end_step}"
    return text + f"stopped after step {summary.end_step} ({summary.stop_reason})"


def _report(kind: str, message: str, code: int) -> int:
    """Hand `message` to the launcher, or print it (errors only; rank 0 already printed where
    an interrupted run stopped). Returns `code`."""
    rank = int(os.environ.get("RANK", "0"))
    if not write_report(RankReport(rank, kind, message, code, attempt())) and kind == "error":
        prefix = f"[rank {rank}] " if world_size_from_env() > 1 else ""
        print(f"{prefix}fivefold train: error: {message}", file=sys.stderr)
    return code
