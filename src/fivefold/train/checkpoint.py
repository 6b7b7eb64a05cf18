"""The training loop's checkpoints: `<run_dir>/ckpt/step_<n>/`, through `fivefold.checkpoint`.

Every rank writes its own shards of the model and optimizer in parallel (torch.distributed
.checkpoint, keyed by global parameter names, so any layout and world size can resume from any
other); the step, LR schedule, data position, RNG states, model spec and plan go to JSON. A
checkpoint becomes visible only when complete (staging directory, manifest of sizes and SHA-256
checksums, rename), so a crash while saving leaves the previous one as the newest; resuming takes
the newest checkpoint whose files verify. See docs/checkpoints.md.

`RunCheckpoints` is what the loop holds; every method is collective (all ranks call it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fivefold.checkpoint import manifest as mf
from fivefold.checkpoint.checkpointer import Checkpointer
from fivefold.checkpoint.state import TrainingState, check_model_spec, read_state
from fivefold.specs.recipe import Recipe


@dataclass(frozen=True)
class RunState:
    """What a checkpoint saves and restores besides the step: this rank's model chunks, the
    optimizer, the LR schedule, the data sampler, and the recipe whose model and plan it
    records."""

    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    recipe: Recipe


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "ckpt"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / mf.step_dir_name(step)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints of a run as (step, directory), oldest first."""
    return mf.list_checkpoints(checkpoint_root(run_dir))


class RunCheckpoints:
    """Save, choose and restore the checkpoints of one run (collective calls)."""

    def __init__(self, run_dir: Path, keep: int, async_save: bool = False):
        self.checkpointer = Checkpointer(checkpoint_root(run_dir), keep=keep, async_save=async_save)

    def select(self) -> mf.Selection:
        """The newest valid checkpoint; removes staging directories of crashed saves."""
        return self.checkpointer.select()

    def save(self, state: RunState, step: int, extra: dict[str, Any]) -> Path:
        """Checkpoint `state` as step `step`; returns its directory."""
        return self.checkpointer.save(
            step,
            state.model_parts,
            state.optimizer,
            model_spec=state.recipe.model.to_dict(),
            plan=state.recipe.plan.to_dict(),
            scheduler=state.scheduler,
            sampler=state.sampler,
            extra=extra,
        )

    def saved_step(self, recipe: Recipe, directory: Path) -> int:
        """The step of `directory`, after checking it holds `recipe`'s model (CheckpointError
        naming the differences otherwise); reads only its state.json."""
        saved = read_state(directory)
        check_model_spec(saved, recipe.model.to_dict(), directory)
        return saved.step

    def restore(self, state: RunState, directory: Path) -> TrainingState:
        """Weights, optimizer, schedule, data position and RNG of `directory`, into `state`'s
        objects; the returned state names the step."""
        return self.checkpointer.load(
            directory,
            state.model_parts,
            state.optimizer,
            model_spec=state.recipe.model.to_dict(),
            scheduler=state.scheduler,
            sampler=state.sampler,
        )

    def wait(self) -> None:
        """Finish an asynchronous save (no collective; safe on error paths)."""
        self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.close()
