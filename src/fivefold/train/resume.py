"""The resume policy of a run: which step it starts from and what it says about it.

`train.resume` (`fivefold.checkpoint.elastic.resume_mode`): "auto" continues from the newest
valid checkpoint when there is one, true always wants one (and says when there is none), false
starts over at step 0 and deletes the run's earlier checkpoints; after an elastic restart a run
always resumes. A run whose checkpoint is already at its last step has nothing to do. The same
choice is checked before any process starts (`resume_problems`): the checkpoint it would resume
must hold the recipe's model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from fivefold.checkpoint.elastic import resume_mode, should_resume
from fivefold.checkpoint.manifest import newest_valid
from fivefold.checkpoint.state import TrainingState, check_model_spec, read_state
from fivefold.errors import CheckpointError
from fivefold.train.checkpoint import RunCheckpoints, RunState, checkpoint_root, list_checkpoints
from fivefold.train.config import RunConfig, TrainConfig
from fivefold.train.spikes import SKIP_FILE


@dataclass(frozen=True)
class Start:
    """Where a run starts: `step`, the checkpoint it came from (None: step 0), and whether that
    checkpoint is already at the run's last step (`complete`: nothing was loaded)."""

    step: int
    checkpoint: Path | None
    complete: bool = False
    extra: dict = field(default_factory=dict)  # the checkpoint's `extra` (the loop's own state)


def choose_start(
    checkpoints: RunCheckpoints,
    state: RunState,
    cfg: TrainConfig,
    last_step: int,
    is_main: bool,
    console: Console,
) -> Start:
    """Resume `state` from the newest valid checkpoint or start over (see the module docstring).
    Collective: every rank calls it; rank 0 prints and deletes."""
    choice = checkpoints.select()
    if choice.skipped and is_main:
        console.print(f"checkpoints not usable, skipped: {choice.describe_skipped()}")
    if should_resume(cfg.resume, choice.path is not None):
        assert choice.path is not None
        saved_step = checkpoints.saved_step(state.recipe, choice.path)
        if saved_step >= last_step:
            return Start(saved_step, choice.path, complete=True)  # nothing to load
        saved = _restore(checkpoints, state, cfg, choice.path, console)
        return Start(saved.step, choice.path, extra=saved.extra)
    if is_main:
        _start_over(cfg, console)
    return Start(0, None)


def _restore(
    checkpoints: RunCheckpoints, state: RunState, cfg: TrainConfig, directory: Path, console
) -> TrainingState:
    """Load `directory` into `state` and say so; returns its saved state."""
    saved = checkpoints.restore(state, directory)
    written_by = f"{saved.world_size} rank(s)"
    if saved.plan and saved.plan != state.recipe.plan.to_dict():
        written_by += " with another layout, resharded"
    how = (
        '; train.resume = "auto": start over with --fresh'
        if resume_mode(cfg.resume) == "auto"
        else ""
    )
    console.print(f"resumed from {directory} (step {saved.step}, written by {written_by}){how}")
    return saved


def _start_over(cfg: TrainConfig, console: Console) -> None:
    """Rank 0: step 0. Old checkpoints (and the data skip list of a loss-spike rollback) are
    deleted only when the user asked to start over."""
    run_dir = cfg.path()
    found = list_checkpoints(run_dir)
    mode = resume_mode(cfg.resume)
    if mode == "never":
        (run_dir / SKIP_FILE).unlink(missing_ok=True)
    if mode != "never":
        if found or mode == "always":
            console.print(
                f"resume: no valid checkpoint in {checkpoint_root(run_dir)}; starting at step 0"
            )
        return
    if found:
        console.print(
            f"note: starting over in {run_dir} as asked (--fresh / train.resume = "
            f"false): deleting its {len(found)} earlier checkpoint(s), newest step "
            f"{found[-1][0]}"
        )
        shutil.rmtree(checkpoint_root(run_dir), ignore_errors=True)


def completion_note(cfg: TrainConfig, step: int) -> str:
    """The one line printed when a re-run finds its checkpoint at `step`, nothing to do."""
    run_dir = cfg.path()
    if cfg.stop_at and step < cfg.steps:
        return (
            f"run {run_dir} stopped at step {step} (train.stop_at = "
            f"{cfg.stop_at}); nothing to do — continue with train.stop_at=0 (to "
            f"train.steps = {cfg.steps}), or start over with --fresh"
        )
    return (
        f"run {run_dir} is complete at step {step}; nothing to do — train further "
        f"with train.steps={max(2 * step, step + 1)}, or start over with --fresh"
    )


def resume_problems(run: RunConfig) -> list[str]:
    """The checkpoint this run would resume from (the newest that passes the quick check) must
    hold this recipe's model: the rank's own check (`check_model_spec`), made before start."""
    if resume_mode(run.train.resume) == "never":
        return []
    root = checkpoint_root(run.train.path())
    if not root.is_dir():
        return []
    choice = newest_valid(root, full=False)
    if choice.path is None:
        return []
    try:
        check_model_spec(read_state(choice.path), run.recipe.model.to_dict(), choice.path)
    except CheckpointError as err:
        return [str(err)]
    return []
