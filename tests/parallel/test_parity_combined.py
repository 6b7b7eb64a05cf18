"""Parity of the 8-rank combinations of the issue with the single-process run."""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [
    ParityCase(
        "DP2xTP2xPP2", {"pp": 2, "dp_replicate": 2, "tp": 2, "micro_batch": 2, "grad_accum": 2}
    ),
]

SLOW_CASES = [
    ParityCase(
        "TP2xCP2xDP2 accum 4",
        {"tp": 2, "cp": 2, "dp_replicate": 2, "micro_batch": 1, "grad_accum": 4},
    ),
    ParityCase("PP2xCP2xTP2", {"pp": 2, "cp": 2, "tp": 2, "micro_batch": 2, "grad_accum": 4}),
    ParityCase(
        "EP2xDP2xPP2 (HSDP 2x2)",
        {
            "pp": 2,
            "dp_replicate": 2,
            "dp_shard": 2,
            "zero": 3,
            "ep": 2,
            "micro_batch": 2,
            "grad_accum": 2,
        },
        model="parity-moe",
    ),
    ParityCase(
        "ZeRO-3xTP2xPP2",
        {"pp": 2, "dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 2, "grad_accum": 2},
    ),
    ParityCase(
        "ZeRO-3xTP2xPP2 dualpipev accum 4",
        {
            "pp": 2,
            "vpp": 2,
            "schedule": "dualpipev",
            "dp_shard": 2,
            "zero": 3,
            "tp": 2,
            "micro_batch": 1,
            "grad_accum": 4,
        },
    ),
    ParityCase(
        "DP2xTP2xPP2 interleaved accum 4 recompute full",
        {
            "pp": 2,
            "vpp": 2,
            "schedule": "interleaved-1f1b",
            "dp_replicate": 2,
            "tp": 2,
            "micro_batch": 1,
            "grad_accum": 4,
            "recompute": "full",
        },
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
