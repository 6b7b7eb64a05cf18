"""Parity of pipeline parallelism, every schedule at 2 and 4 stages, with one process.

The parity model has 8 layers, so PP4 with two virtual stages per rank still gives every stage
a layer. The micro-batch count is the plan's grad_accum (ZBV and DualPipeV need at least
2 * pp of them).
"""

from __future__ import annotations

import pytest
from harness import ParityCase, assert_parity

CI_CASES = [
    ParityCase(
        "PP2 1f1b x ZeRO-1 x2",
        {"pp": 2, "dp_shard": 2, "zero": 1, "micro_batch": 2, "grad_accum": 2},
    ),
]


def _pp_case(pp: int, schedule: str) -> ParityCase:
    vpp = 1 if schedule in ("gpipe", "1f1b") else 2
    accum = 4 if pp == 2 else 8  # interleaved: a multiple of pp; zbv/dualpipev: >= 2 * pp
    return ParityCase(
        f"PP{pp} {schedule}",
        {
            "pp": pp,
            "vpp": vpp,
            "schedule": schedule,
            "grad_accum": accum,
            "micro_batch": 8 // accum,
        },
    )


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
SLOW_CASES = [_pp_case(pp, s) for pp in (2, 4) for s in SCHEDULES] + [
    ParityCase(
        "PP2 1f1b recompute full", {"pp": 2, "grad_accum": 4, "micro_batch": 2, "recompute": "full"}
    ),
]


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_parity_ci(case: ParityCase) -> None:
    assert_parity(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.name)
def test_parity(case: ParityCase) -> None:
    assert_parity(case)
