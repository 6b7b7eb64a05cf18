"""The progress bar of `fivefold data prepare`: input bytes done, bytes/s and tokens/s."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextlib.contextmanager
def prepare_progress(
    total_bytes: int, console: Console | None = None
) -> Iterator[Callable[[int, int], None]]:
    """A callback `(bytes, tokens)` that advances a bar over `total_bytes` input bytes (on
    `console`, default stderr; shown only on a terminal), with bytes/s and tokens/s."""
    console = console or Console(file=sys.stderr)
    columns = (
        TextColumn("tokenising"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    started, tokens = time.perf_counter(), [0]
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("prepare", total=total_bytes, rate="")

        def advance(done_bytes: int, done_tokens: int) -> None:
            tokens[0] += done_tokens
            rate = tokens[0] / max(time.perf_counter() - started, 1e-9)
            bar.update(task, advance=done_bytes, rate=f"{rate:,.0f} tokens/s")

        yield advance
