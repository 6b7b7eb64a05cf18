"""Starting a multi-process run: torchrun on this machine, or an sbatch script for a cluster.

Both run the same entry, `python -m fivefold.train RECIPE [overrides]`, once per rank; the
runtime (`DistributedRuntime`) then reads RANK / WORLD_SIZE / LOCAL_RANK from the environment
torchrun sets and picks gloo on CPU or NCCL on CUDA. The plan is checked against the number of
processes before anything starts, so a layout that does not fit is one clear error, not N
tracebacks.

Locally the agent (`fivefold.launch.agent`, torchrun's own agent with quiet failures) runs in
its own session, so the terminal's Ctrl-C reaches only this launcher, which forwards SIGINT /
SIGTERM to the agent once; the agent forwards it to the ranks, which finish their step, agree to
stop, checkpoint and exit (`fivefold.train.interrupt`). Should anything be left after
`SHUTDOWN_GRACE_S`, the launcher kills the agent and every process it started (found in /proc,
since torchrun puts each worker in a session of its own). Errors the ranks found come back as
files (`fivefold.launch.rank_report`) and are printed once.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import ConfigError, FivefoldError
from fivefold.launch.machine_memory import oom_kill_count
from fivefold.launch.nccl_env import error_handling_export, set_error_handling
from fivefold.launch.rank_report import (
    REPORT_DIR_ENV,
    last_attempt,
    read_failures,
    read_reports,
    summarize,
)
from fivefold.launch.threads import passive_wait
from fivefold.specs.profile import available_cores
from fivefold.specs.profile import threads_per_rank as profile_threads_per_rank

RDZV_PORT = 29500
SLURM_MAX_RESTARTS = 3  # a cluster job restarts by default: failures are routine at scale
AGENT_SHUTDOWN_S = 30  # the agent's wait for the ranks to checkpoint and exit after a signal
SHUTDOWN_GRACE_S = AGENT_SHUTDOWN_S + 15.0  # then the launcher kills whatever is left
POLL_S = 0.2


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use so N ranks do not oversubscribe the cores available (the
    rule the planner's device profiles assume, `fivefold.specs.profile.threads_per_rank`)."""
    return profile_threads_per_rank(nproc, available_cores())


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
    """The local torchrun command line (one node, a free rendezvous port), through the quiet
    agent (`fivefold.launch.agent`, torchrun's options). With `max_restarts` > 0 torchrun
    restarts the whole group after a rank fails, up to that many times, and the restarted run
    resumes from the newest valid checkpoint."""
    return [
        sys.executable,
        "-m",
        "fivefold.launch.agent",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *train_args(recipe_path, overrides),
    ]


def launch_local(
    nproc: int,
    recipe_path: str | Path | None,
    overrides: list[str],
    max_restarts: int = 0,
    memory_note: str = "",
) -> int:
    """Run the recipe on `nproc` local processes under torchrun; returns the job's exit status
    (0 when the last attempt completed, even after restarts).

    The caller has validated the recipe for `nproc` processes
    (`fivefold.train.entry.check_layout`), so a layout that does not fit never starts;
    `memory_note` (the planner's predicted peak, `MemoryFit.describe`) is said should a rank
    be killed by SIGKILL.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: the number of processes must be at least 1.")
    if max_restarts_problems(max_restarts):
        raise ConfigError(max_restarts_problems(max_restarts))

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    passive_wait(env)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(AGENT_SHUTDOWN_S))
    set_error_handling(env)  # torchrun's agent would export its own default to the ranks
    command = torchrun_command(nproc, recipe_path, overrides, max_restarts)
    with tempfile.TemporaryDirectory(prefix="fivefold-ranks-") as reports:
        env[REPORT_DIR_ENV] = reports
        kills_before = oom_kill_count()
        code = run_supervised(command, env)
        found = Path(reports)
        message, code = summarize(
            read_reports(found),
            nproc,
            code,
            read_failures(found),
            last=last_attempt(found),
            sigkill_note=sigkill_cause(kills_before, oom_kill_count(), memory_note),
        )
    if message and code == 2:
        raise FivefoldError(message)
    if message:
        print(f"fivefold train: {message}", file=sys.stderr)
    return code


def sigkill_cause(kills_before: int | None, kills_after: int | None, memory_note: str) -> str:
    """Why a rank was killed by SIGKILL, from the out-of-memory killer's count before and after
    the run (`fivefold.launch.machine_memory.oom_kill_count`), with the predicted peak."""
    if kills_before is None or kills_after is None:
        cause = (
            "The likely cause is the kernel's out-of-memory killer (fivefold never sends SIGKILL; "
            "the kernel log, dmesg, says)"
        )
    elif kills_after > kills_before:
        cause = (
            f"The kernel's out-of-memory killer ended it: its kill count rose by "
            f"{kills_after - kills_before} during the run"
        )
    else:
        cause = (
            "Not the kernel's out-of-memory killer (its kill count did not change): something "
            "outside the run sent SIGKILL"
        )
    return f"{cause}; {memory_note}" if memory_note else cause


def run_supervised(command: list[str], env: dict[str, str]) -> int:
    """Run the agent in its own session and return its exit status. SIGINT / SIGTERM here are
    forwarded to it once; if it has not ended `SHUTDOWN_GRACE_S` later, it and every process
    it started are killed. Nothing it started outlives this call."""
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    tree = ProcessTree(proc.pid)
    signalled_at: float | None = None
    try:
        with _forwarding_signals(proc) as received:
            while proc.poll() is None:
                tree.refresh()
                if received and signalled_at is None:
                    signalled_at = time.monotonic()
                if signalled_at is not None and time.monotonic() - signalled_at > SHUTDOWN_GRACE_S:
                    break
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(POLL_S)
    finally:
        tree.kill()
        proc.wait()
    if received:  # interrupted: 128 + the signal, whatever the agent's status
        return 128 + received[0]
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


@contextmanager
def _forwarding_signals(proc: subprocess.Popen) -> Iterator[list[int]]:
    """Forward the first SIGINT / SIGTERM to `proc`; yields the signals received, in order."""
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ProcessTree:
    """The descendants of one process, remembered as (pid, start time) so that processes which
    were re-parented when their parent died, or in sessions of their own, can still be killed,
    and a recycled pid never is. Reads /proc (Linux); elsewhere it knows only the root."""

    def __init__(self, root: int):
        self.root = root
        self.known: dict[int, str] = {}
        self.refresh()

    def refresh(self) -> None:
        children: dict[int, list[int]] = {}
        for pid, parent in _parent_map().items():
            children.setdefault(parent, []).append(pid)
        frontier = [self.root, *self.known]
        while frontier:
            pid = frontier.pop()
            start = self.known.get(pid) or _start_time(pid)
            if start is None:
                continue
            self.known[pid] = start
            frontier += [c for c in children.get(pid, []) if c not in self.known]

    def alive(self) -> list[int]:
        return [pid for pid, start in self.known.items() if _start_time(pid) == start]

    def kill(self) -> None:
        self.refresh()
        for pid in self.alive():
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":  # a zombie is already dead
        return None
    return fields[19]  # field 22 of stat: start time in clock ticks since boot


def _parent_map() -> dict[int, int]:
    out = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                out[int(entry.name)] = int(fields[1])
    return out


# What sbatch accepts, kept strict so nothing written into the script needs quoting.
SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SLURM_PARTITION = re.compile(r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*")
# --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1)), or "infinite"/"unlimited"
SLURM_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|infinite|unlimited)")


def slurm_job_name(name: str) -> str:
    """`name` with every character sbatch or a file name would trip on replaced by '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "fivefold"
    return cleaned[:128]


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
    chain: tuple[int, int] = (0, 0)  # (jobs, steps per job) of a run split over jobs; 0: one

    def problems(self) -> list[str]:
        out = max_restarts_problems(self.max_restarts)
        if self.nodes < 1:
            out.append(f"--nodes {self.nodes}: a job needs at least one node.")
        if self.gpus_per_node < 1:
            out.append(f"--gpus-per-node {self.gpus_per_node}: must be at least 1.")
        if not SLURM_NAME.fullmatch(self.job_name):
            out.append(
                f"--job-name {self.job_name!r}: use letters, digits, '.', '_' and '-' (at most "
                f"128, starting with a letter or digit), e.g. {slurm_job_name(self.job_name)!r}."
            )
        if not SLURM_TIME.fullmatch(self.time):
            out.append(
                f"--time {self.time!r}: give sbatch's wall-time format, e.g. 04:00:00 "
                "(hours:minutes:seconds), 90 (minutes) or 2-00:00:00 (days-hours:minutes:seconds)."
            )
        if self.partition and not SLURM_PARTITION.fullmatch(self.partition):
            out.append(
                f"--partition {self.partition!r}: a partition name (letters, digits, '.', '_', "
                "'-'; several separated by commas), e.g. gpu."
            )
        if not 1 <= self.port <= 65535:
            out.append(f"rendezvous port {self.port}: must be within 1..65535.")
        return out


def slurm_script(
    job: SlurmJob, recipe_path: str | Path, overrides: list[str], description: str = ""
) -> str:
    """An sbatch script: one task per node, each running torchrun over its GPUs with c10d
    rendezvous on the first node of the allocation; after a rank fails torchrun restarts the
    group up to `job.max_restarts` times and the run resumes from its newest valid checkpoint.

    Every value in a directive is checked (`SlurmJob.problems`, ConfigError); every value on a
    shell line is quoted; the ranks run this interpreter (`sys.executable`, so the cluster's
    nodes need the same path, e.g. a shared file system), not whatever `python` is first on
    the PATH there."""
    if job.problems():
        raise ConfigError(job.problems())
    description = " ".join(description.split())  # a comment line stays one line
    world = job.nodes * job.gpus_per_node
    cpus = job.cpus_per_task or 8 * job.gpus_per_node
    jobs, per_job = job.chain  # more than one job: an array run one task at a time
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
        f"#SBATCH --output={job.job_name}-{'%A_%a' if jobs > 1 else '%j'}.out",
    ]
    if job.partition:
        header.append(f"#SBATCH --partition={job.partition}")
    command = " ".join(shlex.quote(a) for a in train_args(recipe_path, overrides))
    if jobs > 1:  # task i stops after step i x per_job with a checkpoint; the next resumes
        header.append(f"#SBATCH --array=1-{jobs}%1")
        command += f' "train.stop_at=$((SLURM_ARRAY_TASK_ID * {per_job}))"'
    body = [
        "",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={max(1, cpus // job.gpus_per_node)}",
        error_handling_export(),  # before torchrun, whose agent exports its own default
        "",
        f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m torch.distributed.run \\",
        '    --nnodes="$SLURM_NNODES" \\',
        f"    --nproc-per-node={job.gpus_per_node} \\",
        f"    --max-restarts={job.max_restarts} \\",
        '    --rdzv-id="$SLURM_JOB_ID" \\',
        "    --rdzv-backend=c10d \\",
        f'    --rdzv-endpoint="$head_node:{job.port}" \\',
        f"    {command}",
    ]
    return "\n".join(header + body) + "\n"
