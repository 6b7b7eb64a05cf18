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

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fivefold.checkpoint import manifest as mf
from fivefold.checkpoint.checkpointer import Checkpointer
from fivefold.checkpoint.elastic import should_resume
from fivefold.checkpoint.state import TrainingState, check_model_spec, read_state

if TYPE_CHECKING:
    from fivefold.train.loop import Trainer


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

    def wants_resume(self, setting: bool | str, choice: mf.Selection) -> bool:
        """`train.resume` (true / "auto" / false), and always after an elastic restart."""
        return should_resume(setting, choice.path is not None)

    def save(self, trainer: Trainer, extra: dict[str, Any]) -> Path:
        return self.checkpointer.save(
            trainer.step,
            trainer.runtime.model_parts,
            trainer.optimizer,
            model_spec=trainer.recipe.model.to_dict(),
            plan=trainer.recipe.plan.to_dict(),
            scheduler=trainer.scheduler,
            sampler=trainer.data.sampler,
            extra=extra,
        )

    def saved_step(self, trainer: Trainer, directory: Path) -> int:
        """The step of `directory`, after checking it holds this recipe's model (CheckpointError
        naming the differences otherwise); reads only its state.json."""
        state = read_state(directory)
        check_model_spec(state, trainer.recipe.model.to_dict(), directory)
        return state.step

    def restore(self, trainer: Trainer, directory: Path) -> TrainingState:
        """Weights, optimizer, schedule, data position and RNG of `directory`, into `trainer`."""
        state = self.checkpointer.load(
            directory,
            trainer.runtime.model_parts,
            trainer.optimizer,
            model_spec=trainer.recipe.model.to_dict(),
            scheduler=trainer.scheduler,
            sampler=trainer.data.sampler,
        )
        trainer.step = state.step
        return state

    def wait(self) -> None:
        """Finish an asynchronous save (no collective; safe on error paths)."""
        self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.close()
