"""How busy this machine is: the load average against its cores, read once, and whether it
makes a measured time unreliable.

A step time (or a check's duration) measured while other work shares the cores is longer than
the same step on an idle machine; the planner predicts the idle machine. The load average
counts the processes running or waiting for a core, averaged over a minute (`os.getloadavg`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fivefold.specs.profile import available_cores

BUSY_PER_CORE = 1.0  # more processes running or waiting than cores: each waits its turn


@dataclass(frozen=True)
class MachineLoad:
    """One reading: the 1-minute load average and the cores this process may use."""

    load: float
    cores: int

    @property
    def per_core(self) -> float:
        return self.load / max(1, self.cores)

    @property
    def busy(self) -> bool:
        return self.per_core > BUSY_PER_CORE

    def describe(self) -> str:
        return f"load average {self.load:.1f} on {self.cores} core(s)"


def read_load() -> MachineLoad | None:
    """This machine's load now; None where the system has no load average."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    return MachineLoad(load, available_cores())


def load_note(reading: MachineLoad | None, what: str) -> str:
    """A sentence when `reading` says the machine is busy ("" when idle or unknown): `what`
    (e.g. "the measured step times") is slower than on the idle machine predicted."""
    if reading is None or not reading.busy:
        return ""
    return (
        f"note: this machine was busy at the start ({reading.describe()}, beyond "
        f"{BUSY_PER_CORE} per core): {what} will be slower than on the idle machine the "
        "prediction is for, so the comparison is unreliable"
    )
