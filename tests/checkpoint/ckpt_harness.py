"""Run a function on N gloo ranks on CPU for the checkpoint tests.

The ranks come from the multi-rank harness of the parallel tests (`spawn_ranks` in
tests/parallel/harness.py, on the import path through tests/conftest.py): forked from a
forkserver, one FileStore-backed gloo group per call, one thread per rank, the first failing
rank's traceback raised at once. Here every rank is also told its rank and the world size.
"""

from __future__ import annotations

from typing import Any

from harness import spawn_ranks


def run_ranks(
    world: int, fn, *args: Any, timeout_s: float = 180.0, pg_timeout_s: float = 90.0
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` ranks of one gloo group; results in rank order."""
    return spawn_ranks(
        world, fn, args, pass_rank=True, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s
    )
