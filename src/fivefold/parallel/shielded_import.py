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
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM inside the block; on leaving it normally, deliver the first one held
    again with the previous handlers back. Wrap imports in it, not long work: a held Ctrl-C
    waits for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])
