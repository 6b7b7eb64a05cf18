"""Keeping freed host memory (`fivefold.launch.host_memory.keep_freed_memory`, what `fivefold
train` does on every rank) against glibc's defaults, on whole CPU training steps.

Each trial trains one layout of `benchmarks/plan_vs_run.py` (default `1r`: the small preset,
fp32, micro-batch 2, one rank) with the real runtime and loop in fresh processes, with or
without the setting, and takes the median `train_step` over the steps no memory counter runs on.
Trials alternate (default, kept, default, kept, ...) so drifts of the machine hit both alike.
Printed: each setting's median over its trials, and the ratio kept / default (below 1: faster).

    PYTHONPATH=src .venv/bin/python benchmarks/host_memory.py [--layouts 1r,dp2-zero1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import plan_vs_run


def trial(layout: plan_vs_run.Layout, steps: int, keep: bool) -> float:
    """Median step seconds of the slowest stage of `layout`, run once."""
    report = plan_vs_run.measure(layout, steps, keep_memory=keep)
    return max(row["measured_step_s"] for row in report["rows"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1r", help="plan_vs_run layouts (default 1r)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per trial")
    parser.add_argument("--rounds", type=int, default=3, help="trials per setting, alternating")
    args = parser.parse_args()
    for layout in plan_vs_run.select(args.layouts, quick=False):
        seen: dict[str, list[float]] = {"default": [], "kept": []}
        for _ in range(args.rounds):
            for setting in ("default", "kept"):
                seen[setting].append(trial(layout, args.steps, setting == "kept"))
        medians = {k: statistics.median(v) for k, v in seen.items()}
        for setting, values in seen.items():
            runs = ", ".join(f"{v * 1e3:.1f}" for v in values)
            median = medians[setting] * 1e3
            print(f"{layout.name} {setting:>8}: median {median:.1f} ms (trials: {runs})")
        print(f"{layout.name} kept / default: {medians['kept'] / medians['default']:.3f}")


if __name__ == "__main__":
    main()
