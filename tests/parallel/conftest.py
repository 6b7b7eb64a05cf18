"""The parity summary of the multi-rank tests (tests/conftest.py puts the harness on the path).

Every parity case run in the session is listed at the end of the run (max deviations per
layout) and written to `runs/parity/latest.md`, the source of `docs/parity.md`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPORT = Path(__file__).resolve().parents[2] / "runs" / "parity" / "latest.md"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    harness = sys.modules.get("harness")
    results = getattr(harness, "RESULTS", None)
    if not results:
        return
    terminalreporter.section("layout parity against the single-process run")
    for result in results:
        terminalreporter.write_line(result.line())
    rows = [
        "| layout | ranks | max abs(dloss)/loss | max abs(dparam) | max abs(dnorm)/norm | "
        "max abs(daux) | loss step 1 -> 10 | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.case.name} | {r.case.world} | {r.loss_rel_dev:.1e} | {r.param_abs_dev:.1e} | "
            f"{r.norm_rel_dev:.1e} | {r.aux_abs_dev:.1e} | {r.losses[0]:.4f} -> "
            f"{r.losses[-1]:.4f} | "
            f"{r.seconds:.0f} s |"
        )
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(rows) + "\n")
    terminalreporter.write_line(f"written to {REPORT}")
