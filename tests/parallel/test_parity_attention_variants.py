"""Parity of Qwen's attention variants (Q/K/V biases, per-head QK-norm) with one process.

The biases are column-parallel with their weights; the QK-norm weights are replicated, each TP
rank normalising its own heads (their gradient a partial sum over the group). TP4 exceeds the
model's 2 kv heads (replicated keys and their biases).
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [ParityCase("TP2+SP", {"tp": 2, "micro_batch": 8}, model="parity-qwen")]

SLOW_CASES = [
    ParityCase("TP2 without SP", {"tp": 2, "sp": False, "micro_batch": 8}, model="parity-qwen"),
    ParityCase("TP4+SP (kv heads replicated)", {"tp": 4, "micro_batch": 8}, model="parity-qwen"),
    ParityCase("ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}, model="parity-qwen"),
    ParityCase(
        "ZeRO-3 x2 x TP2",
        {"dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 4},
        model="parity-qwen",
    ),
    ParityCase("PP2 1f1b", {"pp": 2, "micro_batch": 2, "grad_accum": 4}, model="parity-qwen"),
    ParityCase("CP2 ring", {"cp": 2, "micro_batch": 8}, model="parity-qwen"),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
