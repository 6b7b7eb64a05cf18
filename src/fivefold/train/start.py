"""A run, top to bottom: `train(run)` lists the start-up steps in the order they happen, each a
call into the module that owns it (docs/start-up.md follows every call down).

    1. settings       the recipe with [train] and [data] parsed once (`entry.load_run`: `run`)
    2. this process   threads, an allocator that keeps freed memory, signals during set-up
    3. runtime        `runtime.make_runtime`: the device, the process group and the 5-D mesh,
                      the model on the meta device, parallelised in the fixed order,
                      materialised and initialised shard by shard
    4. trainer        `loop.Trainer`: data (this rank's slice), optimizer, LR schedule,
                      checkpoint store, the device's peak FLOP/s
    5. restore        `Trainer.prepare_run_dir`: resume from the newest valid checkpoint, or
                      start over (`resume.choose_start`)
    6. the loop       `Trainer.fit` under graceful stop signals, between the header and the
                      footer that print the planner's prediction beside the measurement
"""

from __future__ import annotations

import contextlib
import os

from rich.console import Console

from fivefold.launch.host_memory import keep_freed_memory
from fivefold.launch.threads import configure_threads
from fivefold.train.config import RunConfig
from fivefold.train.interrupt import die_on_signals, stop_on_signals
from fivefold.train.loop import Trainer
from fivefold.train.resume import completion_note
from fivefold.train.runtime import Runtime, make_runtime
from fivefold.train.summary import TrainSummary, planner_prediction, print_footer, print_header

__all__ = ["TrainSummary", "train"]


def train(
    run: RunConfig, runtime: Runtime | None = None, console: Console | None = None
) -> TrainSummary:
    """Train `run` to `train.steps` (resuming per `train.resume`); returns the summary. Rank 0
    prints. A run whose newest checkpoint is already at its last step prints one line saying so
    and returns a summary with no losses (stop_reason "already_complete"). `runtime`: one
    already built (tests), else step 3 builds it."""
    configure_threads()  # 2. this process
    keep_freed_memory()
    # Set-up on N ranks: a signal ends the process at once (nothing to save yet; a rank may be
    # blocked in C++ where no handler runs). The loop installs the graceful handlers.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    with die_on_signals() if distributed else contextlib.nullcontext():
        runtime = runtime or make_runtime(run.recipe, run.train)  # 3. runtime
        try:
            summary = _start_and_fit(run, runtime, console)
        except BaseException:
            runtime.close(failed=True)  # no collective after an error: abort the group
            raise
        runtime.close()
        return summary


def _start_and_fit(run: RunConfig, runtime: Runtime, console: Console | None) -> TrainSummary:
    """Steps 4 to 6 on a built runtime (`train` closes it whatever happens)."""
    trainer = Trainer(run, runtime, console)  # 4. data, optimizer, LR schedule, checkpoints
    trainer.prepare_run_dir()  # 5. restore the newest valid checkpoint, or start over
    if trainer.is_complete:
        trainer.console.print(completion_note(trainer.cfg, trainer.step))
        return TrainSummary.already_complete(
            trainer.run_dir, trainer.step, trainer.peak.label, trainer.last_checkpoint
        )
    prediction, why_not = planner_prediction(run) if runtime.is_main else (None, "")
    if runtime.is_main:
        print_header(trainer.console, run, runtime, trainer.data, trainer.peak, prediction, why_not)
        trainer.stop.running = trainer.step
        trainer.stop.speak(many_ranks=getattr(runtime, "any_rank", None) is not None)
    with stop_on_signals(trainer.stop):  # 6. the loop; Ctrl-C stops after a step, with a checkpoint
        summary = trainer.fit()
    summary.prediction = prediction
    if runtime.is_main:
        reserved = getattr(runtime, "peak_reserved_bytes", 0)
        print_footer(trainer.console, summary, trainer.tokens_per_step, reserved)
        summary.write_json(trainer.run_dir / "summary.json")
    return summary
