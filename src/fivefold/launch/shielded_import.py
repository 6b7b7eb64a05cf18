"""Imports (torch above all) with SIGINT and SIGTERM held until they have loaded.

A Ctrl-C that lands while `import torch` runs raises `KeyboardInterrupt` inside torch's C++
start-up. Measured here (a signal 0.3-1.1 s after `fivefold train --nproc 2` started): the
process either aborted (`terminate called after throwing pybind11::error_already_set`,
status -6) or carried on and, at exit, killed itself with SIGINT (status -2) even after
fivefold had caught the interrupt and returned 130, because CPython remembers a
`KeyboardInterrupt` that escaped C-run code. Holding the signal until the import returns and
then delivering it again with the previous handlers in place makes it behave as if it had
arrived a moment later: SIGINT raises `KeyboardInterrupt` in Python, SIGTERM does what it
would have done.

A program's entry (`python -m fivefold`, the `fivefold` command, the torchrun agent, a rank's
`python -m fivefold.train`) calls `hold_signals` before any other import, so the hold covers
everything it imports on the way (a rank imports `rich` long before torch), and its first
`signals_held` block, placed where the program handles `KeyboardInterrupt`, ends it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Hold:
    """SIGINT/SIGTERM recorded instead of acted on, with the handlers they replaced."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.previous = {sig: signal.signal(sig, self._hold) for sig in HELD_SIGNALS}

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.held.append(signum)

    def end(self, deliver: bool) -> None:
        """Put the previous handlers back; with `deliver`, send the first signal held again."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if deliver and self.held:
            signal.raise_signal(self.held[0])


_started: _Hold | None = None  # the hold `hold_signals` began, until a block ends it
_in_block = False


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def hold_signals() -> None:
    """Hold SIGINT/SIGTERM from now until the end of the next `signals_held` block: the first
    statement of a program's entry. No-op off the main thread or while already held."""
    global _started
    if _started is None and not _in_block and _main_thread():
        _started = _Hold()


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM inside the block (continuing a hold `hold_signals` began); on
    leaving it normally, deliver the first one held again with the previous handlers back.
    Wrap imports in it, not long work: a held Ctrl-C waits for the block. A block inside
    another holds nothing of its own."""
    global _started, _in_block
    if _in_block or not _main_thread():
        yield
        return
    hold, _started, _in_block = _started or _Hold(), None, True
    try:
        yield
    except BaseException:
        hold.end(deliver=False)
        raise
    finally:
        _in_block = False
    hold.end(deliver=True)
