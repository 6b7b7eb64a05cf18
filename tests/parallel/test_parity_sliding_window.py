"""Parity of sliding-window attention with one process: a model whose first
layer attends within 12 keys and whose second attends fully (`parity-window`). Context
parallelism trims its blocks to the window (a ring step wholly outside it computes nothing);
TP, PP and ZeRO-3 carry the layer's window with the layer.
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

MODEL = "parity-window"
CI_CASES = [ParityCase("CP2 ring", {"cp": 2, "micro_batch": 8}, model=MODEL)]

SLOW_CASES = [
    ParityCase("TP2+SP", {"tp": 2, "micro_batch": 8}, model=MODEL),
    ParityCase("PP2 1f1b", {"pp": 2, "micro_batch": 2, "grad_accum": 4}, model=MODEL),
    ParityCase("ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}, model=MODEL),
    ParityCase("CP2 allgather", {"cp": 2, "cp_kind": "allgather", "micro_batch": 8}, model=MODEL),
    ParityCase("CP4 ring", {"cp": 4, "micro_batch": 8}, model=MODEL),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
