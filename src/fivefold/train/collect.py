"""Garbage collection on a schedule: Python's cyclic collector between steps, on every rank at
the same step, as torchtitan does.

Left automatic, the collector runs whenever allocations cross its thresholds: at a different
moment on each rank, so one rank pauses (tens to hundreds of milliseconds with a large model's
Python objects) while the others wait for it in the next collective. `ScheduledCollection`
turns the automatic collector off for the run, collects once at the start and then every
`train.gc_every` steps (generation 1: the young objects a step creates; older cycles are rare
in a training loop), and turns it back on at the end. Reference counting frees everything else
as before; only reference cycles wait for the next scheduled pass.
"""

from __future__ import annotations

import gc


class ScheduledCollection:
    """gc.disable() for the run and gc.collect(1) every `every` steps (0: leave gc alone)."""

    GENERATION = 1

    def __init__(self, every: int):
        self.every = every
        self._was_enabled: bool | None = None

    def start(self) -> None:
        if self.every <= 0 or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(self.GENERATION)

    def step(self, step: int) -> None:
        """Before optimizer step `step` (1-based): collect when it is a multiple of `every`."""
        if self._was_enabled is not None and step % self.every == 0:
            gc.collect(self.GENERATION)

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
