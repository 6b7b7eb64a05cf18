"""Where each step's record goes once its values are read back from the device: metrics.jsonl
and the trackers (TensorBoard / W&B, rank 0 only, every `train.log_every` steps), the console
reporter; the run's events (spikes, rollbacks, stragglers: one console line and one record in
events.jsonl each); and the tallies a run's summary is made of (losses, held-out losses,
throughput, events)."""

from __future__ import annotations

import json
import time

from rich.console import Console

from fivefold.checkpoint.elastic import resume_mode
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
        self.console = console
        self.events: list[dict] = []
        # events.jsonl is history (a rollback's spike stays): appended to, except from scratch
        fresh = start_step == 0 and resume_mode(cfg.resume) == "never"
        self.event_path = run_dir / "events.jsonl" if is_main else None
        if self.event_path is not None and fresh:
            self.event_path.unlink(missing_ok=True)
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

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """The run's rate: the meter's, else the last read-back's (0 without a step)."""
        if not self.losses:
            return 0.0
        if self.meter.steps:
            return self.meter.tokens_per_s
        return tokens_per_step / max(self.step_s, 1e-9)

    def event(self, record: dict, line: str) -> None:
        """One event: `line` on the console (rank 0's), `record` in events.jsonl and the summary."""
        self.events.append(record)
        self.console.print(line, style="yellow", markup=False, highlight=False)
        if self.event_path is not None:
            with self.event_path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")

    def rewind(self, step: int, start_step: int) -> None:
        """Back to the end of step `step` (a rollback): later records leave metrics.jsonl and the
        tallies; the next lap is timed from now."""
        del self.losses[max(0, step - start_step) :]
        self.evals = {s: v for s, v in self.evals.items() if s <= step}
        if self.jsonl is not None:
            path = self.jsonl.path
            self.jsonl.close()
            self.jsonl = JsonlWriter(path, keep_through_step=step)
        self.since = time.perf_counter()

    def close(self) -> None:
        self.reporter.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.board is not None:
            self.board.close()
