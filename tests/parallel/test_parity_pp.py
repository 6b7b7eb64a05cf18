"""Parity of pipeline parallelism, every schedule at 2 and 4 stages, with one process.

The parity model has 8 layers, so PP4 with two virtual stages per rank still gives every stage
a layer. The micro-batch count is the plan's grad_accum (ZBV and DualPipeV need at least
2 * pp of them).

The V schedules (zbv, dualpipev) split each backward into an input pass and a later weight
pass; under ZeRO-3 a forward of the same chunk can come between them and re-shard its FSDP
units, which once lost the weight gradients of those micro-batches (loss off by 2e-3 relative
after 10 steps). The `x ZeRO-3` cases below pin that down.
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

# pp 2 x dp_shard 2 with two chunks per rank; 4 micro-batches (2 * pp) of one sequence each
_V_ZERO3 = {"pp": 2, "vpp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 1, "grad_accum": 4}

CI_CASES = [
    ParityCase(
        "PP2 1f1b x ZeRO-1 x2",
        {"pp": 2, "dp_shard": 2, "zero": 1, "micro_batch": 2, "grad_accum": 2},
    ),
    ParityCase(
        "PP2 dualpipev x ZeRO-3 x2",
        _V_ZERO3 | {"schedule": "dualpipev"},
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
    ParityCase("PP2 zbv x ZeRO-3 x2", _V_ZERO3 | {"schedule": "zbv"}),
    ParityCase("PP2 interleaved-1f1b x ZeRO-3 x2", _V_ZERO3 | {"schedule": "interleaved-1f1b"}),
    ParityCase("PP2 dualpipev x ZeRO-2 x2", _V_ZERO3 | {"schedule": "dualpipev", "zero": 2}),
    ParityCase(
        "MoE PP2 zbv x ZeRO-3 x2 (no EP)", _V_ZERO3 | {"schedule": "zbv"}, model="parity-moe"
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
