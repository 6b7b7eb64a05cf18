"""`fivefold launch`: start a recipe on N local processes, or print an sbatch script for Slurm."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fivefold.errors import ConfigError
from fivefold.launch.launcher import (
    SLURM_MAX_RESTARTS,
    SlurmJob,
    launch_local,
    slurm_job_name,
    slurm_script,
)
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.recipe import build, cluster_from_dict, merge, parse_overrides, read_toml
from fivefold.train.job_time import DEFAULT_TIME, TIME_EXTRA_S, TIME_MARGIN, time_limit

_DESCRIPTION = """\
Start a multi-process training run of a recipe.

  --slurm   print an sbatch script for a multi-node cluster: one task per node, each running
            torchrun over the node's GPUs with c10d rendezvous on the first node. The plan's
            degrees (pp x dp_replicate x dp_shard x cp x tp) must multiply to
            nodes x gpus-per-node (--nodes defaults to what the plan needs); the recipe is
            checked before the script is printed, and must have [train] or [data]. The time
            limit is the planner's predicted run time x 1.25 + 30 min unless --time is given
            (the script and stderr say which). A run longer than --time (a partition's
            limit) becomes a chain of jobs: a job array run one task at a time, task i
            stopping with a checkpoint after step i x K (train.stop_at; K steps fit --time)
            and the next resuming from it. Every
            value in a directive is checked (job name, time, partition), every shell value is
            quoted, and the ranks run this Python (the nodes need the same path).
  --nproc N start N processes on this machine with torchrun (gloo on CPU, NCCL on CUDA); the
            same as `fivefold train --nproc N`.

Each rank runs `python -m fivefold.train RECIPE [overrides]`. With --max-restarts N torchrun
restarts the whole group after a rank fails (even by SIGKILL), up to N times, and the restarted
run resumes from its newest valid checkpoint (set train.ckpt_every so there is a recent one).
"""

_EPILOG = """\
examples:
  fivefold launch --slurm --nodes 8 configs/llama3-8b-dgx-h100.toml > job.sbatch
  fivefold launch --slurm --nodes 1 --gpus-per-node 8 --partition gpu --time 02:00:00 \\
      configs/small-dp2-tp2-pp2.toml train.steps=1000
  fivefold launch --nproc 8 configs/small-dp2-tp2-pp2.toml train.steps=20
  fivefold launch --nproc 8 --max-restarts 2 configs/small-dp2-tp2-pp2.toml train.ckpt_every=10

Options go before the recipe; section.field=value overrides follow it.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a recipe on N local processes, or print a Slurm sbatch script",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "items",
        nargs="+",
        metavar="RECIPE|OVERRIDE",
        help="a recipe file (configs/*.toml) followed by section.field=value overrides",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--slurm", action="store_true", help="print an sbatch script (stdout)")
    mode.add_argument("--nproc", type=int, metavar="N", help="run N local processes now")
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="K",
        help="--slurm: nodes to allocate (default: the recipe's GPUs, the plan's degrees "
        "multiplied, over --gpus-per-node)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        metavar="G",
        help="--slurm: GPUs per node (default: the recipe's cluster.gpus_per_node, else 8)",
    )
    parser.add_argument("--partition", default="", help="--slurm: the partition to submit to")
    parser.add_argument(
        "--time",
        default=None,
        metavar="HH:MM:SS",
        help="--slurm: wall-time limit in sbatch's format (M, H:M:S, D-H:M:S; default: the "
        f"planner's predicted run time x {TIME_MARGIN} + {TIME_EXTRA_S // 60} min for start-up "
        f"and checkpoints, or {DEFAULT_TIME} when it has no prediction; the script says which). "
        "Given and shorter than the run: a chain of jobs that each fit it",
    )
    parser.add_argument(
        "--job-name",
        default="",
        metavar="NAME",
        help="--slurm: job name, also the output file's (letters, digits, '.', '_', '-'; "
        "default: fivefold-<train.name>)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart the group up to N times after a rank fails; it resumes from the newest "
        f"valid checkpoint (default: 0 with --nproc, {SLURM_MAX_RESTARTS} with --slurm)",
    )
    parser.set_defaults(handler=handle)


def _recipe_data(recipe_path: str, overrides: list[str]) -> dict:
    return merge(read_toml(recipe_path), parse_overrides(overrides))


def _check_trains(recipe_path: str, data: dict) -> None:
    """A cluster job must say what to train on: refuse a planner-only recipe."""
    if "train" in data or "data" in data:
        return
    raise ConfigError(
        f"recipe {recipe_path!r} has no [train] or [data] section: it describes a model and "
        "layout for the planner, and as a job it would train on the small embedded corpus with "
        "default settings. Add [train] (steps, lr, ckpt_every, ...) and [data] (shards = a "
        "directory from `fivefold data prepare`), as in configs/small-cpu.toml."
    )


def _default_nodes(data: dict, per_node: int) -> int:
    """Enough nodes for the plan's degrees (or cluster.gpus when the plan names none)."""
    plan = build(ParallelPlan, data.get("plan", {}), "plan", [])
    world = plan.world_size if plan is not None else 1
    gpus = data.get("cluster", {}).get("gpus")
    if world == 1 and isinstance(gpus, int) and gpus > 0:
        world = gpus
    return max(1, -(-world // max(per_node, 1)))


def _gpus_per_node(recipe_path: str, overrides: list[str], explicit: int) -> int:
    """--gpus-per-node, else the recipe's [cluster] as the recipe rules read it (a preset's, a
    whole node of up to 8 of cluster.gpus, or cluster.gpus_per_node), else 8."""
    if explicit:
        return explicit
    cluster = _recipe_data(recipe_path, overrides).get("cluster")
    return cluster_from_dict(cluster).gpus_per_node if isinstance(cluster, dict) and cluster else 8


def _check_allocation(recipe_path: str, overrides: list[str], nodes: int, per_node: int) -> None:
    """The plan's degrees must fill the allocation exactly: say how many nodes they need."""
    data = _recipe_data(recipe_path, overrides)
    problems: list[str] = []
    plan = build(ParallelPlan, data.get("plan", {}), "plan", problems)
    if plan is None or problems or plan.problems():
        return  # check_layout reports these with the whole recipe
    world = nodes * per_node
    if plan.world_size != world:
        fit = (
            f"use --nodes {plan.world_size // per_node}"
            if plan.world_size % per_node == 0
            else f"change --gpus-per-node so it divides {plan.world_size}"
        )
        raise ConfigError(
            f"the plan's degrees multiply to {plan.world_size} GPUs ({plan.describe()}), but "
            f"--nodes {nodes} x --gpus-per-node {per_node} = {world}; {fit}, or change the "
            "plan's degrees."
        )


def handle(args: argparse.Namespace) -> int:
    # lazily: fivefold.train loads numpy and rich, and `fivefold --help` imports this module
    from fivefold.train.entry import check_layout, split_recipe_and_overrides

    recipe_path, overrides = split_recipe_and_overrides(args.items)
    if recipe_path is None:
        raise ConfigError("fivefold launch needs a recipe file, e.g. configs/small-cpu.toml.")
    if args.nproc is not None:
        if args.nproc >= 1:
            check_layout(recipe_path, overrides, args.nproc)
        return launch_local(args.nproc, recipe_path, overrides, args.max_restarts or 0)
    restarts = SLURM_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    data = _recipe_data(recipe_path, overrides)
    _check_trains(recipe_path, data)
    per_node = _gpus_per_node(recipe_path, overrides, args.gpus_per_node)
    job = SlurmJob(
        nodes=_default_nodes(data, per_node) if args.nodes is None else args.nodes,
        gpus_per_node=per_node,
        job_name=args.job_name or "fivefold",
        time=args.time or DEFAULT_TIME,
        partition=args.partition,
        max_restarts=restarts,
    )
    if job.problems():
        raise ConfigError(job.problems())
    world = job.nodes * job.gpus_per_node
    _check_allocation(recipe_path, overrides, job.nodes, job.gpus_per_node)
    run = check_layout(recipe_path, overrides, world, local=False)  # runs elsewhere
    name = args.job_name or slurm_job_name(f"fivefold-{run.train.name}")
    limit, why, chain = time_limit(run, args.time)
    job = dataclasses.replace(job, job_name=name, time=limit, chain=chain)
    print(f"fivefold launch: --time {limit}: {why}", file=sys.stderr)
    description = f"{run.recipe.plan.describe()}; --time {limit}: {why}"
    print(slurm_script(job, recipe_path, overrides, description), end="")
    return 0
