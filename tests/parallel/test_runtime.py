"""`DistributedRuntime` beyond parity: held-out loss, the gradient norm, the rank-0 report."""

from __future__ import annotations

import math

from harness import ParityCase, eval_and_report_run, recipe_dict, reference_for, run_ranks


def test_eval_loss_grad_norm_and_layout_report() -> None:
    """TP2 x DP2 (ZeRO-3): eval_loss equals the training loss of the same batch at the same
    weights and the single-process loss of step 1; the norm is the same without the optimizer
    step; rank 0's report has one row per pipeline stage with measured numbers."""
    case = ParityCase("TP2 x ZeRO-3 x2", {"tp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 4})
    reference = reference_for(case)
    ranks = run_ranks(4, eval_and_report_run, recipe_dict(case), 4, timeout_s=180)
    first = ranks[0]
    assert abs(first["eval"] - reference["losses"][0]) <= 1e-5 * reference["losses"][0]
    assert all(abs(loss - first["eval"]) <= 1e-6 * first["eval"] for loss in first["train"])
    assert abs(first["norm"][0] - reference["norms"][0]) <= 1e-4 * reference["norms"][0]
    assert max(first["norm"]) - min(first["norm"]) <= 1e-6 * first["norm"][0]
    for other in ranks[1:]:
        assert other["eval"] == first["eval"] and other["report"] is None
    report = first["report"].splitlines()
    assert report[0].startswith("layout report: TP2+SP")
    stage_row = report[2].split()
    assert stage_row[:2] == ["0", "0-3"]
    assert "GiB" in report[2] and "ms" in report[2]
    assert math.isfinite(first["eval"])
