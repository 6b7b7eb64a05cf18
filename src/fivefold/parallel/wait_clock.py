"""The time a rank spends waiting for the others in the runtime's own collectives.

`WaitClock.waiting()` wraps each collective the distributed runtime issues itself: the step's
token count (its first collective), the loss all-reduce, the gradient-norm all-reduce and the
stop agreement. On CPU (gloo) each blocks the host, so the time inside is the wait for the last
rank to arrive plus a small transfer; on CUDA the host does not block, so two timing events on
the current stream bracket it and are read after the loop's next read-back (a host sync), with
no sync of their own (unmeasured here: no GPU). Collectives inside FSDP, DDP and the TP styles
are not seen: a rank slow inside its forward or backward is waited for there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class WaitClock:
    """Seconds waited in the wrapped collectives since the last `take`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def waiting(self) -> Iterator[None]:
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start
            return
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((begin, end))

    def take(self) -> float:
        """The seconds waited since the last call (CUDA: call after a host sync, so the events
        have passed; `elapsed_time` is in ms)."""
        total = self.seconds + sum(b.elapsed_time(e) for b, e in self._events) / 1e3
        self.seconds, self._events = 0.0, []
        return total
