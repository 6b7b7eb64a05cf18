"""Parity of expert parallelism on the MoE parity model (4 experts, top-2, a shared expert).

The load-balancing loss is taken over each global micro-batch (with or without EP), so the
single-process reference groups its micro-batches the same way the data-parallel ranks cut theirs.
"""

from __future__ import annotations

from harness import ParityCase
from parity_suite import parity_tests

CI_CASES = [
    ParityCase(
        "EP2 (ZeRO-1 x2)", {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 4}, model="parity-moe"
    ),
    # one expert per EP rank, sharded by ZeRO-3 over 2 ranks: FSDP splits each expert's width
    ParityCase(
        "EP2 x ZeRO-3 x4, 2 experts",
        {"dp_shard": 4, "zero": 3, "ep": 2, "micro_batch": 2},
        model="parity-moe-2e",
    ),
]

SLOW_CASES = [
    ParityCase(
        "MoE ZeRO-1 x2 (no EP)",
        {"dp_shard": 2, "zero": 1, "micro_batch": 4},
        model="parity-moe",
    ),
    ParityCase(
        "MoE PP2 x DP2 (no EP)",
        {"pp": 2, "dp_replicate": 2, "micro_batch": 2, "grad_accum": 2},
        model="parity-moe",
    ),
    ParityCase(
        "EP4 (ZeRO-1 x4)", {"dp_shard": 4, "zero": 1, "ep": 4, "micro_batch": 2}, model="parity-moe"
    ),
    ParityCase(
        "EP2 x ZeRO-3 x4", {"dp_shard": 4, "zero": 3, "ep": 2, "micro_batch": 2}, model="parity-moe"
    ),
    ParityCase(
        "EP2 x CP2",
        {"dp_shard": 2, "cp": 2, "zero": 1, "ep": 2, "micro_batch": 4},
        model="parity-moe",
    ),
    ParityCase(
        "EP2 accum 4",
        {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 1, "grad_accum": 4},
        model="parity-moe",
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)
