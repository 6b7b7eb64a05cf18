"""What the loop does about a loss spike (`train.on_spike`): warn, skip the update, or roll back.

`SpikePolicy` checks every step whose values are read back (`fivefold.train.spikes`): `skip`
reads every step back before its optimizer step (one host sync per step) and drops the update of
a spiking one on every rank alike (the values are all-reduced); `rollback` marks the spiking
step's samples as never to be taken again (`SkipList`, persisted in the run directory) and asks
the loop to return to the last checkpoint (`SpikePolicy.roll_back`). Details: docs/long-runs.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fivefold.checkpoint.elastic import should_resume
from fivefold.errors import TrainingError
from fivefold.train.config import TrainConfig
from fivefold.train.spikes import SKIP_FILE, SkipList, SpikeDetector, SpikeEvent

MAX_ROLLBACKS = 3  # to one checkpoint: more, and the spikes are not the data's


class SpikePolicy:
    """One run's spike detector, skip list and events (`new_events`: not yet logged)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, is_main: bool, sampler: Any = None):
        self.policy = cfg.on_spike
        self.is_main = is_main
        self.detector = SpikeDetector(
            cfg.spike_window, cfg.spike_threshold, cfg.spike_min_steps, cfg.warmup_steps
        )
        path = Path(run_dir) / SKIP_FILE
        # a run that starts over (--fresh) forgets the list; rank 0 deletes the file
        self.skips = SkipList.read(path) if should_resume(cfg.resume, True) else SkipList(path)
        self.new_events: list[SpikeEvent] = []
        self.rollback_due: SpikeEvent | None = None
        self.rollbacks: dict[str, int] = {}  # checkpoint -> times returned to it
        # samples per data source of a range of the global order, where the `sampler` knows
        # (a mixture's `sources(start, count)`); None: one unnamed source
        self.sources_of: Callable[[int, int], dict[str, int]] | None = getattr(
            sampler, "sources", None
        )

    @property
    def every_step(self) -> bool:
        """Whether each step must be read back before its optimizer step (policy `skip`)."""
        return self.policy == "skip"

    def observe(
        self,
        step: int,
        values: tuple[float, float, float],
        samples: tuple[int, int],
        ahead: bool,
        checkpoint: Path | None,
    ) -> bool:
        """Check step `step` (`values`: loss, aux, grad norm; `samples`: its range of the global
        order; `ahead`: its optimizer step has not run; `checkpoint`: the last one). Returns
        whether its update must be skipped."""
        if self.policy == "off" or self.rollback_due is not None:
            return False
        loss, _, grad_norm = values
        found = self.detector.check(step, loss, grad_norm)
        if found is None:
            return False
        metric, threshold, median = found
        value = loss if metric == "loss" else grad_norm
        event = SpikeEvent(step, metric, value, threshold, median, self.policy, samples=samples)
        if self.sources_of is not None:
            event.sources = dict(self.sources_of(samples[0], samples[1] - samples[0]))
        skip = False
        if self.policy == "skip" and ahead:
            event.action = "update skipped (no optimizer step; the data moved on)"
            skip = True
        elif self.policy == "rollback" and checkpoint is not None:
            self._count_rollback(event, checkpoint)
            event.action = (
                f"back to {checkpoint}; samples [{samples[0]}, {samples[1]}) of the data order "
                f"are skipped from now on ({SKIP_FILE})"
            )
            self.skips.add(samples[0], samples[1], step, write=self.is_main)
            self.rollback_due = event
        elif self.policy == "rollback":
            event.action = "no checkpoint yet to return to: warned only"
        else:
            event.action = "warned only"
        self.new_events.append(event)
        return skip

    def _count_rollback(self, event: SpikeEvent, checkpoint: Path) -> None:
        key = str(checkpoint)
        self.rollbacks[key] = self.rollbacks.get(key, 0) + 1
        if self.rollbacks[key] > MAX_ROLLBACKS:
            raise TrainingError(
                f"step {event.step}: {event.metric} spiked again ({event.value:.4g} > "
                f"{event.threshold:.4g}) after {MAX_ROLLBACKS} returns to {checkpoint} with "
                "other data, so the spikes are not the data's: lower train.lr, lengthen "
                "train.warmup_steps or lower train.grad_clip, then resume."
            )

    def next_batch(self, batches: Iterator[list], sampler: Any) -> tuple[list, tuple[int, int]]:
        """The next step's micro-batches from `batches` (which take from `sampler` lazily, when
        asked) and their range of the global sample order, past every skipped range."""
        sampler.consumed = self.skips.advance(sampler.consumed)
        start = sampler.consumed
        micro_batches = next(batches)
        return micro_batches, (start, sampler.consumed)

    def roll_back(
        self, checkpoints: Any, state: Any, checkpoint: Path | None, log: Any, start_step: int
    ) -> int:
        """Return to `checkpoint` (the last one) after the spike `rollback_due`: `state`'s
        weights, optimizer, schedule, data position and RNG, and the detector's windows; the
        step records after it leave `log` (a `StepLog`). The spiking batch is on the skip list
        already. Collective (`checkpoints.restore`); returns the checkpoint's step."""
        event, self.rollback_due = self.rollback_due, None
        assert event is not None and checkpoint is not None
        checkpoints.wait()
        saved = checkpoints.restore(state, checkpoint)
        assert saved.step < event.step, (saved.step, event.step)
        self.detector.load_state_dict(saved.extra.get("spikes"))
        log.rewind(saved.step, start_step)
        return saved.step

    def log_events(self, log: Any) -> None:
        """The spikes found since the last call, to `log` (a `StepLog`)."""
        events, self.new_events = self.new_events, []
        for event in events:
            log.event(event.record(), event.line())
