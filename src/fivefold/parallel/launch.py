"""Starting a multi-process run: torchrun on this machine, or an sbatch script for a cluster.

Both run the same entry, `python -m fivefold.train RECIPE [overrides]`, once per rank; the
runtime (`DistributedRuntime`) then reads RANK / WORLD_SIZE / LOCAL_RANK from the environment
torchrun sets and picks gloo on CPU or NCCL on CUDA. The plan is checked against the number of
processes before anything starts, so a layout that does not fit is one clear error, not N
tracebacks.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import ConfigError

RDZV_PORT = 29500
SLURM_MAX_RESTARTS = 3  # a cluster job restarts by default: failures are routine at scale


def check_layout(recipe_path: str | Path | None, overrides: list[str], world_size: int):
    """Load the recipe for `world_size` processes and refuse what the runtime cannot run
    (recipe loading applies `ParallelPlan.problems`; the degrees must multiply to the world)."""
    from fivefold.parallel.mesh import ParallelDims
    from fivefold.train.entry import load_run

    run = load_run(recipe_path, overrides, world_size=world_size)
    ParallelDims.from_plan(run.recipe.plan, world_size)
    return run


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use so N ranks do not oversubscribe the machine (the rule the
    planner's device profiles assume, `fivefold.spec.profile.threads_per_rank`)."""
    from fivefold.spec.profile import threads_per_rank as rule

    return rule(nproc, os.cpu_count() or 1)


def train_args(recipe_path: str | Path | None, overrides: list[str]) -> list[str]:
    return ["-m", "fivefold.train", *([str(recipe_path)] if recipe_path else []), *overrides]


def max_restarts_problems(max_restarts: int) -> list[str]:
    if max_restarts >= 0:
        return []
    return [
        f"--max-restarts {max_restarts}: must be >= 0 (how many times torchrun restarts the "
        "group after a rank fails; 0 = never, e.g. 3)."
    ]


def torchrun_command(
    nproc: int, recipe_path: str | Path | None, overrides: list[str], max_restarts: int = 0
) -> list[str]:
    """The local torchrun command line (one node, a free rendezvous port). With
    `max_restarts` > 0 torchrun restarts the whole group after a rank fails, up to that many
    times, and the restarted run resumes from the newest valid checkpoint."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *train_args(recipe_path, overrides),
    ]


def launch_local(
    nproc: int, recipe_path: str | Path | None, overrides: list[str], max_restarts: int = 0
) -> int:
    """Run the recipe on `nproc` local processes under torchrun; returns torchrun's exit code."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: the number of processes must be at least 1.")
    if max_restarts_problems(max_restarts):
        raise ConfigError(max_restarts_problems(max_restarts))
    check_layout(recipe_path, overrides, nproc)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    command = torchrun_command(nproc, recipe_path, overrides, max_restarts)
    return subprocess.run(command, env=env).returncode


@dataclass(frozen=True)
class SlurmJob:
    """What an sbatch script needs beyond the recipe."""

    nodes: int
    gpus_per_node: int
    job_name: str = "fivefold"
    time: str = "04:00:00"
    partition: str = ""
    cpus_per_task: int = 0  # 0: 8 per GPU
    port: int = RDZV_PORT
    max_restarts: int = SLURM_MAX_RESTARTS  # torchrun group restarts after a rank fails

    def problems(self) -> list[str]:
        out = max_restarts_problems(self.max_restarts)
        if self.nodes < 1:
            out.append(f"--nodes {self.nodes}: a job needs at least one node.")
        if self.gpus_per_node < 1:
            out.append(f"--gpus-per-node {self.gpus_per_node}: must be at least 1.")
        return out


def slurm_script(
    job: SlurmJob, recipe_path: str | Path, overrides: list[str], description: str = ""
) -> str:
    """An sbatch script: one task per node, each running torchrun over its GPUs with c10d
    rendezvous on the first node of the allocation; after a rank fails torchrun restarts the
    group up to `job.max_restarts` times and the run resumes from its newest valid checkpoint."""
    world = job.nodes * job.gpus_per_node
    cpus = job.cpus_per_task or 8 * job.gpus_per_node
    header = [
        "#!/bin/bash",
        f"# fivefold: {description or 'training run'}",
        f"# {job.nodes} node(s) x {job.gpus_per_node} GPU(s) = {world} ranks; written by "
        "`fivefold launch --slurm`. Submit with: sbatch <this file>",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={job.gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --time={job.time}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={job.job_name}-%j.out",
    ]
    if job.partition:
        header.append(f"#SBATCH --partition={job.partition}")
    command = " ".join(shlex.quote(a) for a in train_args(recipe_path, overrides))
    body = [
        "",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={max(1, cpus // job.gpus_per_node)}",
        "",
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run \\",
        '    --nnodes="$SLURM_NNODES" \\',
        f"    --nproc-per-node={job.gpus_per_node} \\",
        f"    --max-restarts={job.max_restarts} \\",
        '    --rdzv-id="$SLURM_JOB_ID" \\',
        "    --rdzv-backend=c10d \\",
        f'    --rdzv-endpoint="$head_node:{job.port}" \\',
        f"    {command}",
    ]
    return "\n".join(header + body) + "\n"
