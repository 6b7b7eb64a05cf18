"""Parity of MoE layers under tensor parallelism (geometry's expert rule: a MoE layer's tokens
are split over the TP ranks, routed experts stay whole and expert parallelism borrows its ranks
from dp_shard x cp x tp) on the MoE parity model (4 experts, top-2, a shared expert).

CI keeps one small case (TP2 with sequence parallelism and EP over the two TP ranks); the rest,
including all five folds at once on 16 ranks, run with `make parity`.
"""

from __future__ import annotations

import pytest
from harness import ParityCase, assert_parity
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

# All five folds above 1 at once: TP2 (+SP) x PP2 x CP2 x DP2 (ZeRO-1), EP4 over dp_shard x cp x tp
# (the TP pair and the CP pair of each DP rank), 16 gloo ranks; 4 steps keep it near a minute
# on an idle 2-core machine (minutes on a loaded one, hence its own deadline).
FIVE_FOLDS = ParityCase(
    "All five folds: TP2 x PP2 x CP2 x DP2, EP4",
    {
        "tp": 2,
        "sp": True,
        "pp": 2,
        "schedule": "1f1b",
        "cp": 2,
        "dp_shard": 2,
        "zero": 1,
        "ep": 4,
        "micro_batch": 2,
        "grad_accum": 2,
    },
    model="parity-moe",
    steps=4,
)


@pytest.mark.slow
def test_parity_all_five_folds():
    assert FIVE_FOLDS.world == 16
    assert_parity(FIVE_FOLDS, timeout_s=1500.0)
