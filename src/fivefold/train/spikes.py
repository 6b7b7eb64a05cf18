"""Loss spikes: a robust running test on the loss and the gradient norm, and the data skip list.

A step spikes when its loss (or gradient norm) exceeds the median of the last `train.spike_window`
accepted steps by more than `train.spike_threshold` robust standard deviations, the scaled median
absolute deviation (1.4826 x MAD, the standard deviation of a normal sample). Checks start once the
window holds `train.spike_min_steps` steps taken after the learning-rate warm-up. A spiking step
never enters the window. Every input is an all-reduced value (the same on every rank), so every
rank decides the same. The policies (`train.on_spike`) act in the loop; details and sources:
docs/long-runs.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): the MAD of a normal sample times this is its sigma
# A window whose spread is below this fraction of its median (a flat run) is read as that
# fraction, so round-off in a constant loss is never a spike.
MIN_RELATIVE_SPREAD = 1e-3
METRICS = ("loss", "grad_norm")
SPIKE_POLICIES = ("off", "warn", "skip", "rollback")
SKIP_FILE = "skipped_batches.json"


@dataclass
class SpikeEvent:
    """One spiking step: `metric` ("loss" or "grad_norm") at `value` above `threshold` (median
    + k robust sigmas of the window), what the policy did (`action`), and the step's samples
    in the global data order, `[samples[0], samples[1])`."""

    step: int
    metric: str
    value: float
    threshold: float
    median: float
    policy: str
    action: str = ""
    samples: tuple[int, int] = (0, 0)
    sources: dict[str, int] | None = None  # samples per data source, when the data names them

    def record(self) -> dict:
        """The events.jsonl record."""
        return {"event": "spike", **asdict(self), "samples": list(self.samples)}

    def line(self) -> str:
        """The console line."""
        return (
            f"spike at step {self.step}: {self.metric} {self.value:.4g} > threshold "
            f"{self.threshold:.4g} (window median {self.median:.4g}); train.on_spike = "
            f"{self.policy!r}: {self.action}"
        )


@dataclass
class SpikeDetector:
    """The running windows of accepted loss and gradient-norm values (see the module docstring)."""

    window: int
    threshold: float
    min_steps: int
    warmup_steps: int = 0
    values: dict[str, deque] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in METRICS:
            self.values.setdefault(name, deque(maxlen=self.window))

    def limit(self, metric: str) -> tuple[float, float] | None:
        """(threshold, median) of `metric`'s window, None while it holds too few steps."""
        seen = self.values[metric]
        if len(seen) < self.min_steps:
            return None
        median = statistics.median(seen)
        mad = statistics.median(abs(v - median) for v in seen)
        sigma = max(MAD_TO_SIGMA * mad, MIN_RELATIVE_SPREAD * abs(median))
        return median + self.threshold * sigma, median

    def check(self, step: int, loss: float, grad_norm: float) -> tuple[str, float, float] | None:
        """(metric, threshold, median) if step `step` spikes, else None; a step that does not
        spike joins the windows (steps of the warm-up excepted)."""
        observed = {"loss": loss, "grad_norm": grad_norm}
        for metric in METRICS:
            found = self.limit(metric)
            if found is not None and observed[metric] > found[0]:
                return metric, found[0], found[1]
        if step > self.warmup_steps:
            for metric in METRICS:
                self.values[metric].append(observed[metric])
        return None

    def state_dict(self) -> dict:
        """The windows, for a checkpoint's `extra` (JSON)."""
        return {name: list(values) for name, values in self.values.items()}

    def load_state_dict(self, state: dict | None) -> None:
        for name in METRICS:
            self.values[name] = deque(
                (float(v) for v in (state or {}).get(name, [])), maxlen=self.window
            )


class SkipList:
    """Ranges of the global sample order that training never takes again, `[start, end)`, each
    with the step whose batch it was; kept in `<run_dir>/skipped_batches.json` (rank 0 writes,
    atomically) so a restarted run skips them too."""

    def __init__(self, path: Path, ranges: list[list[int]] | None = None):
        self.path = path
        self.ranges: list[list[int]] = [list(r) for r in ranges or []]

    @classmethod
    def read(cls, path: Path) -> SkipList:
        """The list in `path` (empty when there is none)."""
        if not path.is_file():
            return cls(path)
        return cls(path, json.loads(path.read_text()).get("ranges", []))

    def add(self, start: int, end: int, step: int, write: bool) -> None:
        """Skip `[start, end)` (the batch of step `step`) from now on; `write`: save the file."""
        if [start, end, step] not in self.ranges:
            self.ranges.append([start, end, step])
        if write:
            staging = self.path.with_suffix(".tmp")
            staging.write_text(json.dumps({"ranges": self.ranges}, indent=1) + "\n")
            os.replace(staging, self.path)

    def advance(self, consumed: int) -> int:
        """The data position to read from instead of `consumed`: past every skipped range that
        starts there (ranges may follow one another)."""
        moved = True
        while moved:
            moved = False
            for start, end, _ in self.ranges:
                if start == consumed and end > consumed:
                    consumed, moved = end, True
        return consumed


def spike_problems(on_spike: str, window: int, threshold: float, min_steps: int) -> list[str]:
    """The `train.on_spike` / `train.spike_*` settings' own problems, each naming the field."""
    out = []
    if on_spike not in SPIKE_POLICIES:
        out.append(
            f"train.on_spike = {on_spike!r}: choose one of {', '.join(SPIKE_POLICIES)} (warn "
            "logs a spike, skip drops its update, rollback returns to the last checkpoint)."
        )
    if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
        out.append(
            f"train.spike_threshold = {threshold}: must be a positive number of robust standard "
            "deviations, e.g. 7."
        )
    if window < 1:
        out.append(f"train.spike_window = {window}: must be at least 1 step, e.g. 100.")
    if min_steps < 1 or (window >= 1 and min_steps > window):
        out.append(
            f"train.spike_min_steps = {min_steps}: must be between 1 and train.spike_window "
            f"({window}), e.g. 20."
        )
    return out
