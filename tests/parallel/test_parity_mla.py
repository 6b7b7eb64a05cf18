"""Parity of DeepSeek's multi-head latent attention and DeepSeek-V3's MoE with one process.

Under TP the per-head projections (wq_b, wkv_b) are column-parallel and wo row-parallel; the
down projections and the latent norms are replicated (`ReplicateParallel`), their gradients
summed over the heads of every rank. The DeepSeek cases also check the sigmoid router's
score-correction bias, balanced after every step from the expert loads of all data x context
parallel ranks (compared with the parameters).
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [
    ParityCase("MLA TP2+SP", {"tp": 2, "micro_batch": 8}, model="parity-mla", steps=6),
    ParityCase("MLA CP2 ring", {"cp": 2, "micro_batch": 8}, model="parity-mla", steps=6),
]

SLOW_CASES = [
    ParityCase("MLA TP2 without SP", {"tp": 2, "sp": False, "micro_batch": 8}, model="parity-mla"),
    ParityCase("MLA TP4+SP", {"tp": 4, "micro_batch": 8}, model="parity-mla"),
    ParityCase("MLA CP2 ring", {"cp": 2, "micro_batch": 8}, model="parity-mla"),
    ParityCase(
        "MLA ZeRO-3 x2 x TP2",
        {"dp_shard": 2, "zero": 3, "tp": 2, "micro_batch": 4},
        model="parity-mla",
    ),
    ParityCase("MLA PP2 1f1b", {"pp": 2, "micro_batch": 2, "grad_accum": 4}, model="parity-mla"),
    ParityCase(
        "DeepSeek DP2 full recompute",
        {"dp_replicate": 2, "micro_batch": 4, "recompute": "full"},
        model="parity-deepseek",
    ),
    ParityCase("DeepSeek DP2", {"dp_replicate": 2, "micro_batch": 4}, model="parity-deepseek"),
    ParityCase(
        "DeepSeek ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}, model="parity-deepseek"
    ),
    ParityCase(
        "DeepSeek EP2",
        {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 4},
        model="parity-deepseek",
    ),
    ParityCase(
        "DeepSeek PP2 1f1b", {"pp": 2, "micro_batch": 2, "grad_accum": 4}, model="parity-deepseek"
    ),
    ParityCase("DeepSeek CP2 ring", {"cp": 2, "micro_batch": 8}, model="parity-deepseek"),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
