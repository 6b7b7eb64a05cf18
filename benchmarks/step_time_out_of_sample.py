"""Step time out of sample: the planner on model shapes no device profile was measured on.

    fivefold calibrate --nproc 2 --out /tmp/p.toml      # the defaults: small preset, mbs 1
    FIVEFOLD_PROFILE=/tmp/p.toml PYTHONPATH=src .venv/bin/python \
        benchmarks/step_time_out_of_sample.py [--shapes A,B] [--layouts 1r,tp2-sp] [--steps 5]
        [--repeats 3] [--json FILE] [--list]

Held-out shapes (`SHAPES`): widths 192-448, depths 2-6, GQA ratios 1 (MHA) to 7, sequences
192-640, and one MoE; none is a preset, none the calibration's model (the `small` preset
at micro-batch 1, or a `--also` model), and nothing here is fitted to them. Each shape runs the
layouts of `LAYOUTS` (one process; selective and full recompute; DP2 ZeRO-1 and ZeRO-3; TP2 with
sequence parallelism; PP2 1F1B; a MoE shape EP2 instead of TP2, which fivefold's runtime does
not run with experts) on gloo ranks with the real runtime and training loop
(`plan_vs_run.measure`: one thread per rank, the runtime's own step timing, the median over the
steps no memory counter runs on), `--steps` steps each.

Prints per row the predicted and measured step (ms), the error, the same against the busiest
rank's CPU time of the timed step (`plan_vs_run`: on a loaded machine the wall clock counts the
time other processes took, the CPU clock does not; a rank's waits for its peers are in the wall
time only), the load average (1 min) before and after the row, and what the device model read
beyond its measured shapes for the shape (`fivefold.planner.rates.coverage`); then per layout
kind the mean and worst |error|, and over all rows, against the wall clock and the CPU clock.
`--repeats` passes run over all rows in turn (interleaved, so that a change in the machine's
load reaches every row alike); each row then reports its median measured step and the spread
of its passes ((max - min) / median). Step times depend on the machine's load: compare rows
measured at similar load, and quote the load with the figures. About 2 min per pass on an
idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import plan_vs_run
from plan_vs_run import Layout, measure


@dataclass(frozen=True)
class Shape:
    """A held-out model: fields over `preset` (the embedded corpus' 4096-word vocabulary)."""

    name: str
    preset: str
    fields: dict

    def describe(self) -> str:
        f = self.fields
        moe = f" MoE {f['experts']}x top-{f['top_k']}" if "experts" in f else ""
        return (
            f"{self.name}: L{f['layers']} h{f['hidden']} {f['heads']}/{f['kv_heads']} heads of "
            f"{f['head_dim']} ffn {f.get('ffn', '-')} s{f['seq_len']}{moe}"
        )


SHAPES = [
    Shape(
        "mha-320",
        "small",
        dict(layers=3, hidden=320, heads=10, kv_heads=10, head_dim=32, ffn=896, seq_len=256),
    ),
    Shape(
        "gqa3-192",
        "small",
        dict(layers=6, hidden=192, heads=6, kv_heads=2, head_dim=32, ffn=512, seq_len=384),
    ),
    Shape(
        "gqa7-448",
        "small",
        dict(layers=2, hidden=448, heads=14, kv_heads=2, head_dim=32, ffn=1280, seq_len=192),
    ),
    Shape(
        "long-256",
        "small",
        dict(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, seq_len=640),
    ),
    Shape(
        "moe-128",
        "tiny-moe",
        dict(
            layers=4,
            hidden=128,
            heads=4,
            kv_heads=2,
            head_dim=32,
            ffn=352,
            seq_len=256,
            experts=8,
            top_k=2,
            expert_ffn=128,
            shared_experts=1,
        ),
    ),
]
PP = {"pp": 2, "schedule": "1f1b", "micro_batch": 1, "grad_accum": 4}
LAYOUTS = {  # kind: plan over fp32, micro-batch 2, accumulation 1
    "1r": {},
    "1r-selective": {"recompute": "selective"},
    "1r-full": {"recompute": "full"},
    "dp2-zero1": {"dp_shard": 2, "zero": 1, "micro_batch": 1},
    "dp2-zero3": {"dp_shard": 2, "zero": 3, "micro_batch": 1},
    "tp2-sp": {"tp": 2},
    "pp2-1f1b": PP,
}
MOE_INSTEAD = {"tp2-sp": ("ep2", {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 1})}


def runs(shapes: list[Shape], kinds: list[str]) -> list[tuple[Shape, str, Layout]]:
    """(shape, layout kind, layout) of every row to run."""
    out = []
    for shape in shapes:
        for kind in kinds:
            plan = LAYOUTS[kind]
            if "experts" in shape.fields and kind in MOE_INSTEAD:
                kind, plan = MOE_INSTEAD[kind]
            name = f"{shape.name}/{kind}"
            out.append((shape, kind, Layout(name, plan, shape.preset, shape.fields)))
    return out


def extrapolated(shape: Shape) -> str:
    """What the device model reads beyond its measured shapes for `shape` in one process
    (`planner.rates.coverage`), or why that is unknown."""
    from fivefold.planner.rates.coverage import coverage
    from fivefold.planner.rates.device import MeasuredRates, rates_for
    from fivefold.specs import ParallelPlan, model_preset
    from fivefold.specs.hardware import profile_device
    from fivefold.specs.profile import default_profile_path

    path = default_profile_path()
    if not path.is_file():
        return f"no device profile at {path}"
    rates = rates_for(profile_device(path, 1))
    assert isinstance(rates, MeasuredRates)
    model = model_preset(shape.preset).with_(**shape.fields)
    plan = ParallelPlan(micro_batch=2, precision="fp32")
    return coverage(rates, model, plan).describe()


def pct(x: float | None) -> str:
    return f"{x * 100:+7.1f}%" if x is not None else f"{'n/a':>8}"


def by_kind(rows: list[dict], key: str = "error") -> list[str]:
    """Mean and worst |`key`| (the wall-clock "error" or the CPU-clock "cpu_error") per layout
    kind, then over every row."""
    lines = [f"{'layout kind':<14} {'rows':>4} {'mean |err|':>10} {'worst':>8}   ({key})"]
    kinds = dict.fromkeys(r["kind"] for r in rows)
    for kind in [*kinds, "all"]:
        errors = [abs(r[key]) for r in rows if r.get(key) is not None]
        if kind != "all":
            errors = [abs(r[key]) for r in rows if r["kind"] == kind and r.get(key) is not None]
        if errors:
            mean, worst = statistics.mean(errors) * 100, max(errors) * 100
            lines.append(f"{kind:<14} {len(errors):>4} {mean:9.1f}% {worst:7.1f}%")
    return lines


def run_row(shape: Shape, kind: str, layout: Layout, steps: int) -> dict:
    """Measure one layout; the worst stage's predicted and measured step with the load."""
    before = os.getloadavg()[0]
    started = time.perf_counter()
    report = measure(layout, steps)
    after = os.getloadavg()[0]
    rows = plan_vs_run.flatten([report])
    worst = max(rows, key=lambda r: r["measured_step_s"] or 0.0)
    return {
        "shape": shape.name,
        "kind": kind,
        "describe": report["describe"],
        "predicted_step_s": worst["predicted_step_s"],
        "measured_step_s": worst["measured_step_s"],
        "error": worst["step_error"],
        "memory_error": worst["memory_error"],
        "measured_cpu_s": worst["measured_cpu_s"],
        "cpu_error": worst["cpu_error"],
        "load_before": before,
        "load_after": after,
        "wall_s": time.perf_counter() - started,
    }


def pick(names: str | None, known: list[str], flag: str) -> list[str]:
    if not names:
        return known
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)}; choose among {', '.join(known)}")
    return chosen


def median_row(samples: list[dict]) -> dict:
    """One row from its repeats: the median measured step (wall and CPU), the error against it,
    the spread (max - min over the median) and the highest load seen."""
    first = samples[0]
    wall = statistics.median(s["measured_step_s"] for s in samples)
    cpus = [s["measured_cpu_s"] for s in samples if s["measured_cpu_s"]]
    cpu = statistics.median(cpus) if cpus else None
    predicted = first["predicted_step_s"]
    walls = [s["measured_step_s"] for s in samples]
    return {
        **first,
        "measured_step_s": wall,
        "error": predicted / wall - 1.0,
        "measured_cpu_s": cpu,
        "cpu_error": predicted / cpu - 1.0 if cpu else None,
        "spread": (max(walls) - min(walls)) / wall,
        "repeats": len(samples),
        "load_before": max(s["load_before"] for s in samples),
        "load_after": max(s["load_after"] for s in samples),
        "measured_all_s": walls,
    }


def print_row(name: str, row: dict) -> None:
    print(
        f"{name:<24} {row['predicted_step_s'] * 1e3:9.1f} "
        f"{row['measured_step_s'] * 1e3:9.1f} {pct(row['error'])} "
        f"{(row['measured_cpu_s'] or 0.0) * 1e3:8.1f} {pct(row['cpu_error'])} "
        f"{pct(row['memory_error'])} {row.get('spread', 0.0) * 100:6.1f}% "
        f"{row['load_before']:11.2f} {row['load_after']:6.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(s.name for s in SHAPES)}")
    parser.add_argument("--layouts", help=f"comma-separated kinds, of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=5, help="steps per row (>= 4; default 5)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="passes over all rows, interleaved; each row reports its median (default 3)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be >= 4 (plan_vs_run.measure: steps 1, 2 and 4 are not timed)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    names = pick(args.shapes, [s.name for s in SHAPES], "--shapes")
    shapes = [s for s in SHAPES if s.name in names]
    todo = runs(shapes, pick(args.layouts, list(LAYOUTS), "--layouts"))
    if args.list:
        for shape, _kind, layout in todo:
            print(f"{layout.name:<24} {layout.world} rank(s)  {shape.describe()}  {layout.plan}")
        return 0
    for shape in shapes:
        print(f"# {shape.describe()}\n#   {extrapolated(shape)}", flush=True)
    header = (
        f"{'row':<24} {'pred ms':>9} {'meas ms':>9} {'error':>8} {'cpu ms':>8} {'error':>8} "
        f"{'mem err':>8} {'spread':>7} {'load before':>11} {'after':>6}"
    )
    samples: dict[str, list[dict]] = {layout.name: [] for _s, _k, layout in todo}
    for repeat in range(args.repeats):
        print(f"## pass {repeat + 1} of {args.repeats}\n{header}", flush=True)
        for shape, kind, layout in todo:
            row = run_row(shape, kind, layout, args.steps)
            samples[layout.name].append(row)
            print_row(layout.name, row)
    rows = [median_row(samples[layout.name]) for _s, _k, layout in todo]
    print(f"## medians over {args.repeats} interleaved pass(es)\n{header}")
    for (_s, _k, layout), row in zip(todo, rows, strict=True):
        print_row(layout.name, row)
    print("\n".join(by_kind(rows)))
    print("\n".join(by_kind(rows, "cpu_error")))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
