"""Parity with `train.compile = true`: blocks compiled by inductor, every layout against the
single-process run compiled the same way (same tolerances as every parity case).

The first compile of a block's graph takes tens of seconds on a loaded 2-core machine; inductor's
on-disk cache makes later processes with the same graph fast, so the CI case shares its graphs
with its reference (multi-rank runs skip AOTAutograd's cache, see `fivefold.parallel.compile`).
"""

from __future__ import annotations

import pytest
from harness import ParityCase, assert_parity
from parity_suite import parity_tests

TP_CP = "compile TP2+SP x CP2 ring"

CI_CASES = [
    ParityCase(
        "compile ZeRO-3 x2", {"dp_shard": 2, "zero": 3, "micro_batch": 4}, steps=4, compile=True
    ),
    # the embedding hands block 0 an AsyncCollectiveTensor and SP gathers inside the block
    ParityCase("compile TP2+SP", {"tp": 2, "micro_batch": 8}, steps=4, compile=True),
]

SLOW_CASES = [
    ParityCase("compile DP2", {"dp_replicate": 2, "micro_batch": 4}, steps=4, compile=True),
    ParityCase(
        "compile PP2 1f1b x ZeRO-3 x2 recompute full",
        {"pp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 2, "grad_accum": 2, "recompute": "full"},
        steps=4,
        compile=True,
    ),
    ParityCase(
        "compile EP2 x ZeRO-3 x2",
        {"dp_shard": 2, "ep": 2, "zero": 3, "micro_batch": 4},
        model="parity-moe",
        steps=4,
        compile=True,
    ),
    ParityCase("compile CP2 ring", {"cp": 2, "micro_batch": 8}, steps=4, compile=True),
    ParityCase(
        "compile TP2 x DP2",
        {"tp": 2, "sp": False, "dp_replicate": 2, "micro_batch": 4},
        steps=4,
        compile=True,
    ),
    ParityCase(
        "compile TP2+SP x ZeRO-3 x2",
        {"tp": 2, "dp_shard": 2, "zero": 3, "micro_batch": 4},
        steps=4,
        compile=True,
    ),
    ParityCase(
        "compile PP2 x TP2+SP",
        {"pp": 2, "tp": 2, "micro_batch": 4, "grad_accum": 2},
        steps=4,
        compile=True,
    ),
    # the CP core breaks the graph, so TP's input hook compiles on its own with its group's
    # name; with a warm cache a rank of one TP group once loaded the other group's graph
    ParityCase(TP_CP, {"tp": 2, "cp": 2, "micro_batch": 8}, steps=4, compile=True),
]

test_parity_ci, test_parity = parity_tests(CI_CASES, SLOW_CASES)


@pytest.mark.slow
def test_warm_cache_across_layouts(tmp_path, monkeypatch) -> None:
    """One inductor cache shared by runs of different layouts, as on a user's machine: TP alone,
    TP x DP, then TP x CP cold and warm, then TP alone warm. With the graph caches on, the warm
    TP x CP run failed ("Could not resolve the process group registered under the name 15")."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    by_name = {c.name: c for c in CI_CASES + SLOW_CASES}
    tp, tp_dp, tp_cp = (by_name[n] for n in ("compile TP2+SP", "compile TP2 x DP2", TP_CP))
    for case in (tp, tp_dp, tp_cp, tp_cp, tp):
        assert_parity(case)
