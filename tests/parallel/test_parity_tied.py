"""Parity of tied embeddings across pipeline stages: the first stage's embedding and the last
stage's LM head are two copies of one matrix, initialised alike and kept equal by summing their
gradients (`fivefold.parallel.tied_embeddings`). The harness checks both copies against the
single-process model's one matrix, and the gradient norms (which must count it once).

V-shaped schedules hold both copies on pipeline rank 0 (summed locally); the others all-reduce
over the first and last stages' ranks (PP4: a group that skips the middle stages).
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

_V = {"pp": 2, "vpp": 2, "micro_batch": 2, "grad_accum": 4}

CI_CASES = [
    ParityCase(
        "PP2 1f1b tied embeddings",
        {"pp": 2, "schedule": "1f1b", "micro_batch": 4, "grad_accum": 2},
        model="parity-tied",
        steps=6,
    ),
]

SLOW_CASES = [
    ParityCase(
        "PP2 interleaved-1f1b tied", _V | {"schedule": "interleaved-1f1b"}, model="parity-tied4"
    ),
    ParityCase("PP2 zbv tied", _V | {"schedule": "zbv"}, model="parity-tied4"),
    ParityCase("PP2 dualpipev tied", _V | {"schedule": "dualpipev"}, model="parity-tied4"),
    ParityCase(
        "PP4 1f1b tied",
        {"pp": 4, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4},
        model="parity-tied4",
    ),
    ParityCase(
        "PP2 1f1b x ZeRO-3 x2 tied",
        {"pp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 2, "grad_accum": 2},
        model="parity-tied",
    ),
    ParityCase(
        "PP2 dualpipev x ZeRO-3 x2 tied",
        _V | {"dp_shard": 2, "zero": 3, "micro_batch": 1, "schedule": "dualpipev"},
        model="parity-tied4",
    ),
    ParityCase(
        "PP2 1f1b x TP2+SP tied",
        {"pp": 2, "tp": 2, "micro_batch": 4, "grad_accum": 2},
        model="parity-tied",
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
