"""Fit the planner's efficiency model on published runs; check it leave-one-source-out.

    .venv/bin/python scripts/calibrate.py            # fit, leave-one-source-out, write the JSON
    .venv/bin/python scripts/calibrate.py --check    # print the tables of the saved record
    .venv/bin/python scripts/calibrate.py --rerecord # the saved record's errors, re-derived

Both rewrite the tables in docs/planner.md (between its calibration-table markers).

Reads `src/fivefold/planner/data/published_runs.json` (rows copied, with sources, from
../shared/calibration/published_runs.md; each row names its `source_key`) and writes
`src/fivefold/planner/data/efficiency.json`:

- the deployed parameters: a fit on every row of every source;
- leave-one-source-out: for each source, a fit on all the other sources and the error of its
  prediction for every row of the held-out source (what `efficiency.held_out_errors()` reads);
- the in-sample error of every row under the deployed fit, and the memory error of the rows
  that publish a per-GPU memory figure (checked, never fitted).

The docs also get a second table: every row beyond the targets (held-out step time or memory),
with what its source leaves unknown (the row's `unknowns` in the JSON) and, for each unknown
expressed as a `what_if`, the row's errors with it applied, computed here with the estimator and
the held-out fit of the row's source.

The objective is the mean over sources of each source's mean |ln(predicted / measured step
time)|: each publication has one vote (the 25-cell nanotron grid weighs as much as BLOOM's one
row), and the absolute (not squared) loss keeps rows the model misses by tens of percent from
dragging every parameter to a bound.
Nelder-Mead on the logarithms of the parameters (pure Python: a handful of parameters), from
the defaults with two restarts; every held-out fit is made the same way, from the same start, so
nothing of the held-out source reaches it. Eleven fits of about 800 estimates of every row, the
held-out ones `--jobs` at a time (one process each, 2 by default).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fivefold.planner.budget.published import (
    profile_errors,
    run_errors,
    what_if_error,
    what_if_label,
)
from fivefold.planner.frameworks import DEFAULT_PROFILE, profiles
from fivefold.planner.rates.efficiency import (
    EFFICIENCY_FILE,
    FITTED,
    EfficiencyModel,
    calibration_record,
    published_runs,
    skipped_runs,
)

START = EfficiencyModel()
BOUNDS = {
    "gemm_peak_fraction.ampere": (0.3, 0.98),
    "gemm_peak_fraction.hopper": (0.3, 0.98),
    "gemm_half_intensity": (0.01, 5.0),
    "attention_peak_fraction": (0.35, 0.75),
    "hbm_fraction": (0.3, 0.95),
    "layer_overhead_s": (1e-7, 1e-3),
}
TARGET_MEAN, TARGET_MAX, TARGET_MEMORY = 0.05, 0.12, 0.05
RESTARTS = (0.5, 0.15)  # simplex sizes (in log units) of the successive Nelder-Mead runs


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


START_X = [math.log(get(START, name)) for name in FITTED]


def sources_of() -> dict[str, list[str]]:
    """Row ids per source, in the JSON's order."""
    out: dict[str, list[str]] = defaultdict(list)
    for row in published_runs():
        out[row["source_key"]].append(row["id"])
    return dict(out)


def objective(x: list[float], sources: dict[str, list[str]]) -> float:
    """Mean over `sources` of the mean absolute log step-time ratio |ln(pred/meas)| of their
    rows: one vote per publication, and robust (a row the model misses by tens of percent does
    not drag every parameter to a bound as a squared loss would)."""
    model = with_values(START, decode(x))
    rows = {r for ids in sources.values() for r in ids}
    errors = {e.row: e.error for e in run_errors(model, pipeline="analytic", rows=rows)}
    per_source = [
        sum(abs(math.log1p(errors[r])) for r in ids) / len(ids) for ids in sources.values()
    ]
    return sum(per_source) / len(per_source)


def nelder_mead(f, x0: list[float], step: float = 0.3, iters: int = 600, tol: float = 1e-9):
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


def fit(
    sources: dict[str, list[str]], start: list[float], steps: tuple[float, ...], iters: int
) -> tuple[list[float], float]:
    """Nelder-Mead from `start`, restarted with a fresh simplex of each size in `steps` from the
    best point so far (a simplex can stall on a bound); the best point found."""
    best, value = list(start), objective(start, sources)
    for step in steps:
        x, v = nelder_mead(lambda x: objective(x, sources), best, step=step, iters=iters)
        if v < value:
            best, value = x, v
    return best, value


def stats(errors: list[float]) -> dict:
    errs = [abs(e) for e in errors]
    return {"rows": len(errs), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs)}


def held_out_fit(held: str, iters: int) -> dict:
    """Fit on every source but `held` exactly as the deployed fit is made (same start, same
    restarts), then predict the rows of `held` (simulated pipeline)."""
    sources = sources_of()
    rest = {k: v for k, v in sources.items() if k != held}
    x, value = fit(rest, START_X, RESTARTS, iters)
    values = decode(x)
    model = with_values(START, values)
    errors = [(e.row, e.error) for e in run_errors(model, rows=set(sources[held]))]
    return {
        "parameters": values,
        "objective": value,
        "held_out": [{"row": r, "error": err} for r, err in errors],
        **stats([err for _, err in errors]),
    }


def leave_one_source_out(iters: int, jobs: int) -> dict[str, dict]:
    """`held_out_fit` for every source, `jobs` of them at a time (independent fits)."""
    held = list(sources_of())
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(held_out_fit, held, [iters] * len(held)))
    out = dict(zip(held, results, strict=True))
    for key, entry in out.items():
        mean, worst = entry["mean_abs_error"], entry["max_abs_error"]
        print(
            f"  held out {key:<22} {len(entry['held_out']):>3} rows: mean {mean * 100:5.1f} %, "
            f"max {worst * 100:5.1f} %"
        )
    return out


def rerecord(record: dict) -> dict:
    """`record` re-derived at its own parameters, nothing fitted: every row's in-sample error
    under the deployed parameters, and each held-out source's errors and objective under its
    recorded parameters. For a planner change that moves predictions; the parameters stay
    those of the last fit (the full command refits them)."""
    sources = sources_of()
    rows = in_sample(EfficiencyModel.from_dict(record["parameters"]))
    loso = {}
    for held, entry in record["loso"].items():
        model = with_values(START, entry["parameters"])
        errors = [(e.row, e.error) for e in run_errors(model, rows=set(sources[held]))]
        rest = {k: v for k, v in sources.items() if k != held}
        x = [math.log(entry["parameters"][name]) for name in FITTED]
        loso[held] = {
            **entry,
            "objective": objective(x, rest),
            "held_out": [{"row": r, "error": err} for r, err in errors],
            **stats([err for _, err in errors]),
        }
    return {**record, "errors": rows, "loso": loso, "summary": summarise(rows, loso)}


def in_sample(model: EfficiencyModel) -> list[dict]:
    rows = []
    for e in run_errors(model):
        rows.append(
            {
                "row": e.row,
                "source": e.source,
                "measured": e.measured_text,
                "measured_step_s": e.measured_step_s,
                "predicted_step_s": e.predicted_step_s,
                "error": e.error,
                "measured_memory_bytes": e.measured_memory_bytes,
                "predicted_memory_bytes": e.predicted_memory_bytes,
                "memory_error": e.memory_error,
            }
        )
    return rows


def summarise(rows: list[dict], loso: dict[str, dict]) -> dict:
    held = [h["error"] for s in loso.values() for h in s["held_out"]]
    memory = [r["memory_error"] for r in rows if r["memory_error"] is not None]
    return {
        "in_sample": stats([r["error"] for r in rows]),
        "held_out": stats(held),
        "memory": stats(memory),
        "targets": {"mean": TARGET_MEAN, "max": TARGET_MAX, "memory": TARGET_MEMORY},
    }


def beyond_targets(record: dict) -> list[tuple[dict, float, float | None]]:
    """(row, held-out step error, memory error) of every row whose held-out step-time error
    exceeds TARGET_MAX or whose memory error exceeds TARGET_MEMORY, in the JSON's order."""
    held = {h["row"]: h["error"] for s in record["loso"].values() for h in s["held_out"]}
    memory = {r["row"]: r["memory_error"] for r in record["errors"]}
    out = []
    for row in published_runs():
        step, mem = held[row["id"]], memory[row["id"]]
        if abs(step) > TARGET_MAX or (mem is not None and abs(mem) > TARGET_MEMORY):
            out.append((row, step, mem))
    return out


def unknowns_table(record: dict) -> list[str]:
    """The rows beyond the targets, one line per unknown, with the what-if errors."""
    lines = [
        "Rows beyond the targets (held-out step error over "
        f"{TARGET_MAX * 100:.0f} % or memory error over {TARGET_MEMORY * 100:.0f} %), and what "
        "their source leaves unknown; each what-if is priced with the estimator and the held-out "
        "fit of the row's source:",
        "",
        "| row | held-out error | memory error | what the source leaves unknown | what if "
        "| held-out error then | memory error then |",
        "|---|---|---|---|---|---|---|",
    ]
    said: dict[str, str] = {}  # text -> the first row that says it (later rows refer to it)
    for row, step, mem in beyond_targets(record):
        params = record["loso"][row["source_key"]]["parameters"]
        efficiency = with_values(START, params)
        first = f"| {row['id']} | {pct(step)} | {pct(mem)} |"
        entries = row.get("unknowns") or [{"text": "**none recorded** (an error of the data)"}]
        for i, entry in enumerate(entries):
            what_if = entry.get("what_if")
            cells, label = "| | |", ""
            if what_if:
                e = what_if_error(row, what_if, efficiency)
                label = what_if_label(what_if)
                cells = f"| {pct(e.error)} | {pct(e.memory_error)} |"
            text = entry["text"]
            text = f"as row {said[text]}" if text in said else text
            said.setdefault(entry["text"], row["id"])
            lead = first if i == 0 else "| | | |"
            lines.append(f"{lead} {text} | {label} {cells}")
    return lines


DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
START_MARK = "<!-- calibration-table:start -->"
END_MARK = "<!-- calibration-table:end -->"


def pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.1f} %"


def markdown(record: dict) -> str:
    rows, loso, summary = record["errors"], record["loso"], record["summary"]
    in_source = defaultdict(list)
    for r in rows:
        in_source[r["source"]].append(r["error"])
    params = record["parameters"]
    values = [f"`{name}` {get(EfficiencyModel.from_dict(params), name):.4g}" for name in FITTED]
    lines = [
        "Deployed (all-source) parameters: " + ", ".join(values) + ".",
        "",
        "| held-out source | rows | held-out mean abs | held-out max abs | in-sample mean abs "
        "| in-sample max abs |",
        "|---|---|---|---|---|---|",
    ]
    for key, s in loso.items():
        ins = stats(in_source[key])
        lines.append(
            f"| {key} | {s['rows']} | {s['mean_abs_error'] * 100:.1f} % | "
            f"{s['max_abs_error'] * 100:.1f} % | {ins['mean_abs_error'] * 100:.1f} % | "
            f"{ins['max_abs_error'] * 100:.1f} % |"
        )
    h, i, m = summary["held_out"], summary["in_sample"], summary["memory"]
    lines.append(
        f"| **all** | {h['rows']} | **{h['mean_abs_error'] * 100:.1f} %** | "
        f"**{h['max_abs_error'] * 100:.1f} %** | {i['mean_abs_error'] * 100:.1f} % | "
        f"{i['max_abs_error'] * 100:.1f} % |"
    )
    per_source = [s["mean_abs_error"] for s in loso.values()]
    lines.append(
        f"| per source | {len(per_source)} sources | "
        f"{sum(per_source) / len(per_source) * 100:.1f} % (mean of the means) | | | |"
    )
    lines += [
        "",
        f"Memory rows (checked, not fitted): {m['rows']} rows, mean abs "
        f"{m['mean_abs_error'] * 100:.1f} %, max abs {m['max_abs_error'] * 100:.1f} % "
        f"(target {TARGET_MEMORY * 100:.0f} %).",
        "",
        "| row | source | measured | measured step (s) | predicted step (s) | in-sample error "
        "| held-out error | memory error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    held = {h["row"]: h["error"] for s in loso.values() for h in s["held_out"]}
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['source']} | {r['measured']} | {r['measured_step_s']:.3f} | "
            f"{r['predicted_step_s']:.3f} | {pct(r['error'])} | {pct(held[r['row']])} | "
            f"{pct(r['memory_error'])} |"
        )
    lines += ["", *profiles_table(record)]
    lines += ["", *unknowns_table(record)]
    lines += ["", "| skipped row | source | why the planner cannot express it |", "|---|---|---|"]
    for s in record["skipped"]:
        lines.append(f"| {s['id']} | {s['source_key']} | {s['reason']} |")
    return "\n".join(lines)


def framework_rows() -> dict[str, set[str]]:
    """Row ids per framework profile (`megatron-2022`, ...): the rows that name it."""
    out: dict[str, set[str]] = defaultdict(set)
    for row in published_runs():
        if row.get("profile", DEFAULT_PROFILE) != DEFAULT_PROFILE:
            out[row["profile"]].add(row["id"])
    return out


def profile_stats(record: dict) -> dict[tuple[str, str], dict]:
    """{(framework, profile): step-time and memory error stats} of every profile on every
    framework's rows, held out (`profile_errors` with each source's leave-one-source-out fit)."""
    held = {k: with_values(START, v["parameters"]) for k, v in record["loso"].items()}
    out = {}
    for framework, rows in framework_rows().items():
        for name in profiles():
            errors = profile_errors(name, held, rows)
            memory = [e.memory_error for e in errors if e.memory_error is not None]
            out[framework, name] = {
                "time": stats([e.error for e in errors]),
                "memory": stats(memory) if memory else None,
            }
    return out


def profiles_table(record: dict) -> list[str]:
    """Markdown: each framework's rows under every profile (`profile_stats`), held out."""
    names = list(profiles())
    lines = [
        "Efficiency profiles on their frameworks' rows (each row planned as `--profile NAME` "
        "plans it, with the leave-one-source-out fit of its source; step time, mean "
        "abs / max abs, and the same of memory where the rows publish it):",
        "",
        "| rows of | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    table = profile_stats(record)
    for framework, rows in framework_rows().items():
        cells = []
        for name in names:
            t, m = table[framework, name]["time"], table[framework, name]["memory"]
            cell = f"{t['mean_abs_error'] * 100:.1f} / {t['max_abs_error'] * 100:.1f} %"
            if m:
                cell += (
                    f"; memory {m['mean_abs_error'] * 100:.1f} / {m['max_abs_error'] * 100:.1f} %"
                )
            cells.append(f"**{cell}**" if name == framework else cell)
        lines.append(f"| `{framework}` ({len(rows)}) | " + " | ".join(cells) + " |")
    return lines


def publish(record: dict) -> None:
    """Print the tables and put them between the markers of docs/planner.md."""
    text = markdown(record)
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
        "--check", action="store_true", help="print the tables of the saved record; fit nothing"
    )
    parser.add_argument(
        "--rerecord",
        action="store_true",
        help="re-derive the saved record's errors and objectives at its parameters; fit nothing",
    )
    parser.add_argument("--iters", type=int, default=250, help="Nelder-Mead iterations per run")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="held-out fits run at once, one process each (default: 2 or the CPU count)",
    )
    args = parser.parse_args(argv)
    if args.check:
        publish(calibration_record())
        return 0
    if args.rerecord:
        record = rerecord(calibration_record())
        Path(EFFICIENCY_FILE).write_text(json.dumps(record, indent=1) + "\n")
        publish(record)
        print(f"\nwrote {EFFICIENCY_FILE} (parameters unchanged, errors re-derived)")
        return 0
    sources = sources_of()
    best, value = fit(sources, START_X, RESTARTS, args.iters)
    fitted = decode(best)
    n_rows = sum(len(v) for v in sources.values())
    model = with_values(START, fitted).with_(
        source=f"scripts/calibrate.py on {n_rows} published runs from {len(sources)} sources "
        f"({_dt.date.today().isoformat()})"
    )
    print(f"all-source fit: objective {value:.6f}")
    for name in FITTED:
        print(f"  {name} = {fitted[name]:.6g}")
    print("leave-one-source-out:")
    loso = leave_one_source_out(args.iters, args.jobs)
    rows = in_sample(model)
    record = {
        "parameters": model.to_dict(),
        "fitted": list(FITTED),
        "objective": "mean over sources of their rows' mean |ln(predicted / measured step)|",
        "sources": sources,
        "errors": rows,
        "loso": loso,
        "skipped": skipped_runs(),
        "summary": summarise(rows, loso),
    }
    Path(EFFICIENCY_FILE).write_text(json.dumps(record, indent=1) + "\n")
    publish(record)
    print(f"\nwrote {EFFICIENCY_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
