"""What `plan check` (and `train --dry-run`) says while it runs: the time it expects before it
starts, then each stage's phases as they begin, on stderr (stdout carries the table or JSON).

The expected time is a fit to the five cases of docs/plan-check.md, timed on an idle 2-core
machine (each within about a third): a stage costs a start (process, imports, the fake world)
plus a share per block pass (a layer of the stage through one micro-batch under fake tensors),
and stages run `workers` at a time. A busy machine (its load average) is said to be slower.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from fivefold.launch.machine_load import MachineLoad, read_load

STAGE_START_S = 15.0  # process start, imports, the runtime built for the fake world
BLOCK_PASS_S = 0.045  # one layer through one micro-batch: forward, backward, counters


def expected_seconds(layers: int, pp: int, micro_batches: int, workers: int) -> float:
    """Seconds the check should take on an idle 2-core machine: ceil(pp / workers) rounds of
    one stage each, STAGE_START_S + BLOCK_PASS_S x (layers / pp) x micro_batches."""
    rounds = math.ceil(pp / max(1, workers))
    return rounds * (STAGE_START_S + BLOCK_PASS_S * layers / pp * micro_batches)


def expectation_line(recipe: Any, world: int, micro_batches: int, workers: int) -> str:
    """The line printed before the check starts."""
    plan, model = recipe.plan, recipe.model
    seconds = expected_seconds(model.layers, plan.pp, micro_batches, workers)
    load = read_load()
    return (
        f"plan check: {plan.pp} pipeline stage(s) of {world} ranks, one rank each, {workers} at "
        f"a time, {micro_batches} micro-batch(es) of the step; expect about {seconds:.0f} s on "
        f"an idle 2-core machine{_busy(load)}"
    )


def _busy(load: MachineLoad | None) -> str:
    if load is None or not load.busy:
        return ""
    return f", longer here ({load.describe()})"


class StageProgress:
    """One checked rank's phases, said on stderr as each begins, with the seconds since its
    start (runs in the rank's own process)."""

    def __init__(self, stage: int, rank: int) -> None:
        self.stage, self.rank = stage, rank
        self.started = time.perf_counter()

    def __call__(self, phase: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(
            f"plan check: stage {self.stage} (rank {self.rank}), {elapsed:5.1f} s: {phase}",
            file=sys.stderr,
            flush=True,
        )
