"""Where each step's record goes once its values are read back from the device: metrics.jsonl
and the trackers (TensorBoard / W&B, rank 0 only, every `train.log_every` steps), the console
reporter; and the tallies a run's summary is made of (losses, held-out losses, throughput)."""

from __future__ import annotations

import time

from rich.console import Console

from fivefold.train.config import RunConfig
from fivefold.train.metrics import ConsoleReporter, JsonlWriter, StepMetrics, ThroughputMeter
from fivefold.train.trackers import Trackers


class StepLog:
    """The step records of one invocation, from `start_step` on (rank 0 writes the files).

    `since`: the clock at the last read-back (steps are timed between read-backs); `step_s`:
    the last read-back's time per step (s); `started`: the clock when the steps began."""

    def __init__(self, console: Console, run: RunConfig, start_step: int, is_main: bool):
        cfg = run.train
        run_dir = cfg.path()
        self.log_every = cfg.log_every
        self.jsonl = (
            JsonlWriter(run_dir / "metrics.jsonl", keep_through_step=start_step)
            if is_main
            else None
        )
        self.board = Trackers(run_dir, run.recipe, cfg, start_step) if is_main else None
        self.reporter = ConsoleReporter(
            console, cfg.steps, start_step, cfg.log_every, cfg.progress and is_main
        )
        self.meter = ThroughputMeter()
        self.losses: list[float] = []
        self.evals: dict[int, float] = {}
        self.started = self.since = time.perf_counter()
        self.step_s = 0.0

    def lap(self, steps: int) -> float:
        """The time per step of the `steps` steps read back now: the time since the last
        read-back, shared evenly (one step's own time when every step reads back)."""
        now = time.perf_counter()
        self.step_s = (now - self.since) / steps
        self.since = now
        return self.step_s

    def write(self, metrics: StepMetrics) -> None:
        """One step's record to metrics.jsonl, the trackers (on log steps) and the console."""
        self.losses.append(metrics.loss)
        if self.jsonl is not None:
            self.jsonl.write(metrics.to_json())
        if self.board is not None and metrics.step % self.log_every == 0:
            self.board.write(metrics)
        self.reporter.update(metrics)

    def close(self) -> None:
        self.reporter.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.board is not None:
            self.board.close()
