"""Parity of MoE layers under tensor parallelism (geometry's expert rule: a MoE layer's tokens
are split over the TP ranks, routed experts stay whole and expert parallelism borrows its ranks
from dp_shard x cp x tp) on the MoE parity model (4 experts, top-2, a shared expert).

CI keeps one small case (TP2 with sequence parallelism and EP over the two TP ranks); the rest,
including all five folds at once on 16 ranks, run with `make parity`.
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [
    ParityCase(
        "MoE TP2 SP x EP2", {"tp": 2, "sp": True, "ep": 2, "micro_batch": 8}, model="parity-moe"
    ),
]

SLOW_CASES = [
    ParityCase("MoE TP2 SP (no EP)", {"tp": 2, "sp": True, "micro_batch": 8}, model="parity-moe"),
    ParityCase(
        "MoE TP2 no SP x EP2", {"tp": 2, "sp": False, "ep": 2, "micro_batch": 8}, model="parity-moe"
    ),
    ParityCase(
        "MoE TP2 x ZeRO-1 x2, EP4",
        {"tp": 2, "sp": True, "dp_shard": 2, "zero": 1, "ep": 4, "micro_batch": 4},
        model="parity-moe",
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
