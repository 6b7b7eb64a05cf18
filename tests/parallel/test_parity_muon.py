"""Parity of `train.optimizer = "muon"` with the single-process Muon run on every kind of
layout: ZeRO shards and TP shards are gathered into whole matrices for Newton-Schulz, pipeline
stages orthogonalise their own matrices.

With Newton-Schulz in fp32 (`train.muon_ns_dtype = "fp32"`) the contract and tolerances are
every parity case's (loss within 1e-5 relative at every step, parameters within 1e-4). In bf16
(torch.optim.Muon's, the default) a layout's gradients, summed in another order, round to other
bf16 values in places and five iterations amplify that: measured 2.1e-4 on the parameters and
5e-7 on the loss after 6 steps of the CI layout (fp32: 4.4e-7 and 1.2e-7), so the bf16 case
is held to 1e-3 on the parameters.
"""

from __future__ import annotations

import pytest
from harness import LOSS_RTOL, ParityCase, run_parity
from parity_suite import parity_tests

MUON = {"optimizer": "muon", "muon_ns_dtype": "fp32"}
ZERO3_TP2 = {"dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 4}

CI_CASES = [
    ParityCase("Muon ZeRO-3 x2 TP2", ZERO3_TP2, model="parity-tied", steps=6, train=MUON),
]

SLOW_CASES = [
    ParityCase("Muon ZeRO-1 x2", {"dp_shard": 2, "zero": 1, "micro_batch": 4}, train=MUON),
    ParityCase(
        "Muon ZeRO-3 x2 accum 2",
        {"dp_shard": 2, "zero": 3, "micro_batch": 2, "grad_accum": 2},
        train=MUON,
    ),
    ParityCase("Muon DP2", {"dp_replicate": 2, "micro_batch": 4}, train=MUON),
    ParityCase("Muon TP2", {"tp": 2, "micro_batch": 8}, train=MUON),
    ParityCase(
        "Muon PP2 1F1B",
        {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4},
        train=MUON,
    ),
    ParityCase("Muon CP2 ring", {"cp": 2, "micro_batch": 8}, train=MUON),
    ParityCase(
        "Muon EP2 (ZeRO-1 x2), MoE",
        {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 4},
        model="parity-moe",
        train=MUON,
    ),
    ParityCase(
        "Muon DP2 ZeRO-3 TP2 PP2",
        {
            "dp_shard": 2,
            "zero": 3,
            "tp": 2,
            "pp": 2,
            "schedule": "1f1b",
            "micro_batch": 2,
            "grad_accum": 2,
        },
        train=MUON,
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)

BF16_PARAM_ATOL = 1e-3


@pytest.mark.slow
def test_bf16_newton_schulz_stays_within_its_rounding() -> None:
    case = ParityCase(
        "Muon bf16 ZeRO-3 x2 TP2",
        ZERO3_TP2,
        model="parity-tied",
        steps=6,
        train={"optimizer": "muon"},
    )
    result = run_parity(case)
    print(result.line())
    assert not result.missing
    assert result.loss_rel_dev <= LOSS_RTOL
    assert result.param_abs_dev <= BF16_PARAM_ATOL
