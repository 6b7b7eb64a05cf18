"""How long a cluster job of a run takes: sbatch's `--time` from the planner's predicted step
time (x TIME_MARGIN + TIME_EXTRA_S), or, when a given limit is shorter, a chain of jobs that each
fit it and resume from the last one's checkpoint; sbatch's time formats."""

from __future__ import annotations

import math
from typing import Any

from fivefold.errors import ConfigError, FivefoldError
from fivefold.planner.estimate import estimate
from fivefold.planner.frameworks import planner_settings

DEFAULT_TIME = "04:00:00"  # sbatch --time when the planner has no prediction
TIME_MARGIN = 1.25  # the predicted run time is multiplied by this ...
TIME_EXTRA_S = 1800  # ... and this is added (start-up, checkpoints, the first steps)
LONG_JOB_S = 7 * 86400  # beyond a week, say that partitions rarely allow it


def predicted_step_s(run: Any) -> tuple[float | None, int, str]:
    """(the planner's seconds per step, or None; the steps this run takes; why no prediction),
    with the recipe's [planner] profile and options."""
    recipe = run.recipe
    planner = recipe.section("planner")
    steps = min(run.train.stop_at, run.train.steps) if run.train.stop_at else run.train.steps
    try:
        settings = planner_settings(recipe.cluster.device, planner, compile=run.train.compile)
        step_s = estimate(recipe.model, recipe.cluster, recipe.plan, settings.options).step_time_s
    except FivefoldError as err:
        return None, steps, f"the planner has no prediction ({str(err).splitlines()[0]})"
    return step_s, steps, ""


def time_limit(run: Any, given: str | None) -> tuple[str, str, tuple[int, int]]:
    """sbatch's --time, why, and the chain (jobs, steps per job; (0, 0): one job): as given,
    and when the prediction x TIME_MARGIN + TIME_EXTRA_S is longer, a chain of jobs that each
    fit it; else the prediction x TIME_MARGIN + TIME_EXTRA_S, else DEFAULT_TIME."""
    step_s, steps, why_not = predicted_step_s(run)
    if step_s is None:
        return (
            given or DEFAULT_TIME,
            ("as given; " if given else "a fixed default; ") + why_not,
            (0, 0),
        )
    seconds = steps * step_s
    predicted = f"{steps:,} steps x {step_s:.3f} s predicted = {slurm_time(seconds)}"
    limit_s = seconds * TIME_MARGIN + TIME_EXTRA_S
    if given:
        if slurm_seconds(given) >= limit_s:
            return given, f"as given; {predicted}", (0, 0)
        chain = chained_jobs(steps, step_s, slurm_seconds(given), given)
        return given, f"as given; {predicted}; {chain_words(chain)}", chain
    long = (
        "; longer than most partitions allow: give the partition's limit as --time and the "
        "script runs as a chain of jobs, each resuming from the last one's checkpoint"
        if limit_s > LONG_JOB_S
        else ""
    )
    return (
        slurm_time(limit_s),
        f"{predicted}, x {TIME_MARGIN} + {TIME_EXTRA_S // 60} min{long}",
        (0, 0),
    )


def chained_jobs(steps: int, step_s: float, job_s: float, given: str) -> tuple[int, int]:
    """(jobs, steps per job): the most steps whose prediction x TIME_MARGIN + TIME_EXTRA_S fits
    one job of `job_s` seconds, and the jobs that take `steps`; ConfigError when not one does."""
    per_job = math.floor((job_s - TIME_EXTRA_S) / (step_s * TIME_MARGIN))
    if per_job < 1:
        raise ConfigError(
            f"--time {given}: too short for one step ({step_s:.3f} s predicted, x {TIME_MARGIN}) "
            f"after {TIME_EXTRA_S // 60} min for start-up and checkpoints; give at least "
            f"{slurm_time(step_s * TIME_MARGIN + TIME_EXTRA_S)}."
        )
    return math.ceil(steps / per_job), per_job


def chain_words(chain: tuple[int, int]) -> str:
    jobs, per_job = chain
    return (
        f"SHORTER than the run: {jobs} chained jobs of up to {per_job:,} steps (a job array run "
        "one task at a time; task i stops after step i x "
        f"{per_job:,} with a checkpoint, train.stop_at, and the next resumes from it)"
    )


def slurm_seconds(text: str) -> float:
    """sbatch's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, sec = [*parts, 0, 0][:3]
    else:  # M, M:S, H:M:S
        h, m, sec = ([0, *parts, 0] if len(parts) < 3 else parts)[:3]
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec


def slurm_time(seconds: float) -> str:
    """Seconds as sbatch's D-HH:MM:SS (HH:MM:SS under a day), rounded up to the minute."""
    minutes = max(1, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    text = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text
