"""Parity of tensor (+ sequence) parallelism and context parallelism with one process.

TP4 exceeds the parity model's 2 kv heads, so it checks kv-head replication; the CP cases use
packed documents (document masks) with the load-balanced causal layout.
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [
    ParityCase("TP2+SP x CP2, 1 kv head", {"tp": 2, "cp": 2, "micro_batch": 8}, model="parity-mqa"),
]

SLOW_CASES = [
    ParityCase("TP2+SP", {"tp": 2, "micro_batch": 8}),
    ParityCase("TP4+SP (kv heads replicated)", {"tp": 4, "micro_batch": 8}),
    ParityCase("TP2 without SP", {"tp": 2, "sp": False, "micro_batch": 8}),
    ParityCase("TP2+SP tied embeddings", {"tp": 2, "micro_batch": 8}, model="parity-tied"),
    ParityCase("TP2+SP recompute selective", {"tp": 2, "micro_batch": 8, "recompute": "selective"}),
    ParityCase("CP2 ring", {"cp": 2, "micro_batch": 8}),
    ParityCase("CP4 ring", {"cp": 4, "micro_batch": 8}),
    ParityCase("CP2 allgather", {"cp": 2, "cp_kind": "allgather", "micro_batch": 8}),
    ParityCase("CP2 ulysses", {"cp": 2, "cp_kind": "ulysses", "micro_batch": 8}),
    ParityCase(
        "CP2 ring recompute selective", {"cp": 2, "micro_batch": 8, "recompute": "selective"}
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
