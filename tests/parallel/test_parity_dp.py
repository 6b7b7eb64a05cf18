"""Parity of data parallelism (DDP, ZeRO-1/2/3, HSDP) with the single-process run.

Each case trains 10 steps of the parity model on 8 sequences per step and must match the
single-process run: loss within 1e-5 relative at every step, parameters within 1e-4.
"""

from __future__ import annotations

import pytest
from harness import (
    ParityCase,
    mixed_precision_run,
    recipe_dict,
    reference_for,
    run_ranks,
)
from parity_suite import parity_tests

CI_CASES = [
    ParityCase(
        "ZeRO-3 x2 accum 2 recompute full",
        {"dp_shard": 2, "zero": 3, "micro_batch": 2, "grad_accum": 2, "recompute": "full"},
    ),
]

SLOW_CASES = [
    ParityCase("DP2", {"dp_replicate": 2, "micro_batch": 4}),
    ParityCase("ZeRO-1 x2 accum 4", {"dp_shard": 2, "zero": 1, "micro_batch": 1, "grad_accum": 4}),
    ParityCase("ZeRO-2 x2", {"dp_shard": 2, "zero": 2, "micro_batch": 4}),
    ParityCase("ZeRO-2 x2 accum 4", {"dp_shard": 2, "zero": 2, "micro_batch": 1, "grad_accum": 4}),
    ParityCase("ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}),
    ParityCase("ZeRO-1 x4", {"dp_shard": 4, "zero": 1, "micro_batch": 2}),
    ParityCase("ZeRO-2 x4", {"dp_shard": 4, "zero": 2, "micro_batch": 2}),
    ParityCase("ZeRO-3 x4", {"dp_shard": 4, "zero": 3, "micro_batch": 2}),
    ParityCase("HSDP 2x2", {"dp_replicate": 2, "dp_shard": 2, "zero": 3, "micro_batch": 2}),
    ParityCase(
        "ZeRO-3 x2 tied embeddings",
        {"dp_shard": 2, "zero": 3, "micro_batch": 4},
        model="parity-tied",
    ),
    ParityCase(
        "DP4 recompute selective", {"dp_replicate": 4, "micro_batch": 2, "recompute": "selective"}
    ),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)


@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_master_weights() -> None:
    """bf16-mixed under ZeRO-3: forward in bf16, fp32 sharded weights, loss close to fp32."""
    case = ParityCase("bf16 ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}, steps=4)
    reference = reference_for(case)
    recipe = recipe_dict(case)
    recipe["plan"]["precision"] = "bf16-mixed"
    ranks = run_ranks(2, mixed_precision_run, recipe, case.steps, 2)
    assert ranks[0]["param_dtypes"] == ["torch.float32"]
    assert ranks[0]["compute_dtypes"] == ["torch.bfloat16"]
    for bf16, ref in zip(ranks[0]["losses"], reference["losses"], strict=True):
        assert abs(bf16 - ref) / ref < 2e-2
