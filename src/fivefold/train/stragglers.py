"""Stragglers: the rank every other rank waits for, named once.

At each log step every rank measures, since the previous one, its wall time and the time it
waited for the others in the runtime's own collectives (`fivefold.parallel.wait_clock`);
compute = wall - wait. One small all-gather brings every rank's pair to every rank. A rank
whose compute exceeds the ranks' median by more than `train.straggler_threshold` (a fraction)
at `train.straggler_log_steps` consecutive log steps is named once: rank, host, local device,
its lag per step. Every rank decides alike from the gathered numbers; rank 0 prints and writes.
Details: docs/long-runs.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from fivefold.train.config import TrainConfig


@dataclass
class StragglerEvent:
    """Rank `rank` on `host` (local device `local_device`) computed `compute_s` seconds per step
    against the ranks' median `median_s` at step `step`, after `log_steps` slow log steps."""

    step: int
    rank: int
    host: str
    local_device: int
    compute_s: float
    median_s: float
    log_steps: int

    @property
    def lag_s(self) -> float:
        return self.compute_s - self.median_s

    def record(self) -> dict:
        """The events.jsonl record."""
        return {"event": "straggler", **asdict(self), "lag_s": self.lag_s}

    def line(self) -> str:
        """The console line."""
        share = self.lag_s / self.median_s if self.median_s > 0 else float("inf")
        return (
            f"straggler at step {self.step}: rank {self.rank} (host {self.host}, local device "
            f"{self.local_device}) computes {self.compute_s * 1e3:.1f} ms per step against the "
            f"ranks' median {self.median_s * 1e3:.1f} ms (+{share:.0%}, lag "
            f"{self.lag_s * 1e3:.1f} ms) for {self.log_steps} log steps; the others wait for it"
        )


def slow_ranks(compute_s: list[float], threshold: float) -> list[int]:
    """The ranks whose compute time exceeds the median by more than `threshold` x median."""
    median = statistics.median(compute_s)
    return [r for r, c in enumerate(compute_s) if c > (1.0 + threshold) * median]


class StragglerWatch:
    """The straggler detector of one run on `runtime` (inactive on one process)."""

    def __init__(self, runtime: object, cfg: TrainConfig):
        self.runtime = runtime
        self.active = getattr(runtime, "world_size", 1) > 1 and hasattr(runtime, "gather_timing")
        self.threshold = cfg.straggler_threshold
        self.patience = cfg.straggler_log_steps
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()
        self.places: list[tuple[str, int]] | None = None
        self.since = time.perf_counter()
        self.last_step = 0  # the step timing started after

    def restart(self, step: int) -> None:
        """Time from now, after step `step` (the steps begin; or again after a rollback)."""
        self.since, self.last_step = time.perf_counter(), step
        if self.active:
            self.runtime.wait_clock.take()

    def at_log_step(self, step: int) -> list[StragglerEvent]:
        """Gather the timing of the steps since the last call (collective: every rank calls it
        at the same steps); returns the ranks named now."""
        steps, self.last_step = step - self.last_step, step
        if not self.active or steps < 1:
            return []
        now = time.perf_counter()
        wall, self.since = now - self.since, now
        wait = self.runtime.wait_clock.take()
        rows = self.runtime.gather_timing([max(0.0, wall - wait) / steps, wait / steps])
        compute = [row[0] for row in rows]
        slow = set(slow_ranks(compute, self.threshold))
        for rank in range(len(compute)):
            self.streak[rank] = self.streak.get(rank, 0) + 1 if rank in slow else 0
        due = [r for r in sorted(slow) if self.streak[r] >= self.patience and r not in self.named]
        if not due:
            return []
        if self.places is None:
            self.places = self.runtime.gather_places()
        self.named.update(due)
        median = statistics.median(compute)
        return [
            StragglerEvent(step, r, *self.places[r], compute[r], median, self.streak[r])
            for r in due
        ]
