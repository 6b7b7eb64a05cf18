"""Fit the planner's efficiency model on published runs and report its error on every row.

    .venv/bin/python scripts/calibrate.py            # fit, print the table, write the JSON
    .venv/bin/python scripts/calibrate.py --check    # only print the table for the saved fit

Both also rewrite the error table in docs/planner.md (between its calibration-table markers).

Reads `src/fivefold/planner/data/published_runs.json` (rows copied, with sources, from
../shared/calibration/published_runs.md) and writes `src/fivefold/planner/data/efficiency.json`
with the fitted parameters, which rows were used for the fit and which were held out, and the
error of predicted step time against every row. The fit minimises the mean squared relative
step-time error over the fit rows with Nelder-Mead on the logarithms of the parameters (pure
Python: a handful of parameters and rows need nothing more).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from pathlib import Path

from fivefold.planner.calibration import (
    EFFICIENCY_FILE,
    FITTED,
    EfficiencyModel,
    efficiency_model,
)
from fivefold.planner.published import run_errors

# Alternate rows of each source go into the fit; the rest are held out to check it.
FIT_ROWS = (1, 3, 5, 7, 9, 36, 38, 40, 42, 44, 60)
HELD_OUT_ROWS = (2, 4, 6, 8, 10, 37, 39, 41, 43, 61)
START = EfficiencyModel()
BOUNDS = {
    "gemm_peak_fraction.ampere": (0.3, 0.98),
    "gemm_peak_fraction.hopper": (0.3, 0.98),
    "gemm_half_intensity": (0.01, 5.0),
    "attention_peak_fraction": (0.35, 0.75),
    "hbm_fraction": (0.3, 0.95),
    "layer_overhead_s": (1e-7, 1e-3),
}


def get(model: EfficiencyModel, name: str) -> float:
    if name.startswith("gemm_peak_fraction."):
        return dict(model.gemm_peak_fraction)[name.split(".", 1)[1]]
    return getattr(model, name)


def with_values(base: EfficiencyModel, values: dict[str, float]) -> EfficiencyModel:
    table = dict(base.gemm_peak_fraction)
    plain = {}
    for name, value in values.items():
        if name.startswith("gemm_peak_fraction."):
            table[name.split(".", 1)[1]] = value
        else:
            plain[name] = value
    return base.with_(gemm_peak_fraction=tuple(sorted(table.items())), **plain)


def decode(x: list[float]) -> dict[str, float]:
    out = {}
    for name, xi in zip(FITTED, x, strict=True):
        lo, hi = BOUNDS[name]
        out[name] = min(hi, max(lo, math.exp(xi)))
    return out


def objective(x: list[float], rows: tuple[int, ...]) -> float:
    model = with_values(START, decode(x))
    errors = {e.row: e.error for e in run_errors(model, pipeline="analytic")}
    return sum(errors[r] ** 2 for r in rows) / len(rows)


def nelder_mead(f, x0: list[float], step: float = 0.3, iters: int = 600, tol: float = 1e-10):
    """Minimise f from x0 (standard coefficients: reflect 1, expand 2, contract 0.5, shrink
    0.5)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (p - b) for b, p in zip(best, q, strict=True)] for q in simplex[1:]
                ]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    best = min(range(n + 1), key=lambda i: values[i])
    return simplex[best], values[best]


def table(model: EfficiencyModel) -> tuple[list[dict], dict]:
    rows = []
    for e in run_errors(model):
        rows.append(
            {
                "row": e.row,
                "split": "fit" if e.row in FIT_ROWS else "held-out",
                "measured": e.measured_text,
                "measured_step_s": e.measured_step_s,
                "predicted_step_s": e.predicted_step_s,
                "error": e.error,
            }
        )

    def stats(selected: list[dict]) -> dict:
        errs = [abs(r["error"]) for r in selected]
        return {
            "rows": len(errs),
            "mean_abs_error": sum(errs) / len(errs),
            "max_abs_error": max(errs),
        }

    summary = {
        "all": stats(rows),
        "fit": stats([r for r in rows if r["split"] == "fit"]),
        "held-out": stats([r for r in rows if r["split"] == "held-out"]),
    }
    return rows, summary


DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
START_MARK = "<!-- calibration-table:start -->"
END_MARK = "<!-- calibration-table:end -->"


def markdown(rows: list[dict], summary: dict) -> str:
    lines = [
        "| row | split | measured | measured step (s) | predicted step (s) | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['split']} | {r['measured']} | {r['measured_step_s']:.3f} | "
            f"{r['predicted_step_s']:.3f} | {r['error'] * 100:+.1f} % |"
        )
    lines += ["", "| rows | count | mean abs error | max abs error |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['rows']} | {s['mean_abs_error'] * 100:.1f} % | "
            f"{s['max_abs_error'] * 100:.1f} % |"
        )
    return "\n".join(lines)


def print_table(rows: list[dict], summary: dict) -> None:
    """Print the error table and put it between the markers of docs/planner.md."""
    text = markdown(rows, summary)
    print(text)
    if DOCS.is_file():
        doc = DOCS.read_text()
        if START_MARK in doc and END_MARK in doc:
            head, rest = doc.split(START_MARK, 1)
            _, tail = rest.split(END_MARK, 1)
            DOCS.write_text(f"{head}{START_MARK}\n{text}\n{END_MARK}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="print the error table of the saved parameters; fit nothing",
    )
    parser.add_argument("--iters", type=int, default=600, help="Nelder-Mead iterations")
    args = parser.parse_args(argv)
    if args.check:
        model = efficiency_model()
        print_table(*table(model))
        return 0
    # Nelder-Mead from the defaults, then restarts from the best point so far with a fresh
    # simplex (it can stall on a bound); keep the best.
    best = [math.log(get(START, name)) for name in FITTED]
    value = objective(best, FIT_ROWS)
    for step in (0.5, 0.3, 0.15):
        x, v = nelder_mead(lambda x: objective(x, FIT_ROWS), best, step=step, iters=args.iters)
        if v < value:
            best, value = x, v
    fitted = decode(best)
    model = with_values(START, fitted).with_(
        source=f"scripts/calibrate.py on {len(FIT_ROWS)} published runs "
        f"({_dt.date.today().isoformat()})"
    )
    rows, summary = table(model)
    print_table(rows, summary)
    print(f"\nfit objective (mean squared relative error): {value:.6f}")
    for name in FITTED:
        print(f"  {name} = {fitted[name]:.6g}")
    record = {
        "parameters": model.to_dict(),
        "fitted": list(FITTED),
        "fit_rows": list(FIT_ROWS),
        "held_out_rows": list(HELD_OUT_ROWS),
        "objective": "mean squared relative step-time error over the fit rows",
        "errors": rows,
        "summary": summary,
    }
    Path(EFFICIENCY_FILE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {EFFICIENCY_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
