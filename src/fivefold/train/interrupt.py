"""Ctrl-C and SIGTERM during training: stop at the next step boundary, on every rank at once.

Details: docs/internals.md (`fivefold.train.interrupt`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_GRACE_S = 2.0  # a repeat within this window is the same interrupt delivered twice


class StopRequest:
    """The first stop signal this process received (None: keep training).

    `announce(signum)`, when set, runs inside the handler of the first signal: the run says at
    once that it stops after the current step (which may take minutes) instead of after it.
    """

    def __init__(self, announce: Callable[[int], None] | None = None) -> None:
        self.signal: int | None = None
        self._at = 0.0
        self.announce = announce
        self.running = 0  # one process: the step a request from now on comes after
        self.on_agreed: Callable[[int], None] | None = None  # N ranks: said once they agree

    def speak(self, many_ranks: bool) -> None:
        """Say the first signal at once on stderr (a step may take minutes), and on N ranks
        (`many_ranks`) the step they stop after once they agree on it."""
        self.announce = lambda sig: acknowledge(sig, None if many_ranks else self.running)
        self.on_agreed = announce_agreed_stop if many_ranks else None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def agreed(self, runtime: object, at_read_back: bool, next_step: int = 0) -> bool:
        """Whether any rank was asked to stop. On N ranks a collective (`runtime.any_rank`: one
        small all-reduce and its read-back), asked only right after a read-back
        (`at_read_back`), so all ranks leave the loop after the same step (`next_step` - 1)
        and can checkpoint it together; `on_agreed` names that step then, when it is known.
        In one process a request from here on comes after `next_step`."""
        asked, self.running = self.requested, next_step
        agree = getattr(runtime, "any_rank", None)
        if agree is None:
            return asked
        stop = agree(asked) if at_read_back else False
        if stop and self.on_agreed is not None:
            self.on_agreed(next_step - 1)
        return stop

    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention for a process ended by a signal."""
        return 128 + int(self.signal or signal.SIGINT)

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._at = signum, now
            if self.announce is not None:
                self.announce(signum)
        elif now - self._at > REPEAT_GRACE_S:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")


def acknowledge(signum: int, step: int | None, fd: int = 2) -> None:
    """Say on `fd` (stderr) that the run stops after `step`, or (None: N ranks, which agree on
    the step only at their next read-back) that it stops with a checkpoint once they agree. A
    raw write: the handler may run while the main thread is inside a print to the same stream."""
    name = signal.Signals(signum).name
    when = "once every rank has agreed on the step" if step is None else f"after step {step}"
    os.write(
        fd,
        f"\n{name} received: stopping {when} with a checkpoint "
        f"(send it again to stop at once, without one)\n".encode(),
    )


def announce_agreed_stop(step: int, fd: int = 2) -> None:
    """Say on `fd` the step every rank agreed to stop after."""
    os.write(fd, f"stopping after step {step} with a checkpoint\n".encode())


@contextmanager
def stop_on_signals(request: StopRequest | None = None) -> Iterator[StopRequest]:
    """Record stop signals in `request` during the block (main thread only; elsewhere nothing
    is caught)."""
    request = request or StopRequest()
    with _handlers(request.handle):
        yield request


@contextmanager
def die_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM end the process at once during the block (their default action)."""
    with _handlers(signal.SIG_DFL):
        yield


@contextmanager
def _handlers(handler) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
