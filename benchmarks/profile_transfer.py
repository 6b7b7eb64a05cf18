"""Does one device profile serve every model? The planner's step time for a model under several
profiles, beside measured step times.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_transfer.py PROFILE [PROFILE ...]
        [--model-set layers=4,hidden=384,heads=6,kv_heads=2,ffn=1024] [--only 1r,1r-full,tp2-sp]
        [--measured plan_vs_run.json]

For each `benchmarks/plan_vs_run.py` layout (fp32, micro-batch 2, the small preset with the
`--model-set` fields over it) it prints the planner's step time less its optimizer step (what
plan_vs_run compares with the runtime's `train_step`) under each profile, and its error against
the first profile's (e.g. one calibrated on that very model) and, with `--measured`, against a
plan_vs_run JSON's measured wall and CPU times. Typical use: calibrate once with the defaults
(small preset), once on the model (`fivefold calibrate model.layers=4 ... plan.micro_batch=2`),
and compare; a profile describes the device when the first error is small. Needs no run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from plan_vs_run import _overrides, select


def predicted_step_s(layout, profile: str) -> float:
    """The planner's step seconds less the optimizer step for `layout` under `profile`."""
    from fivefold.planner.estimate import estimate
    from fivefold.planner.options import PlannerOptions
    from fivefold.train.entry import load_run

    items = [*_overrides(layout, 8, "/tmp/unused"), f"cluster.profile={json.dumps(profile)}"]
    recipe = load_run(None, items, world_size=layout.world).recipe
    options = replace(PlannerOptions.for_device(recipe.cluster.device), runtime="fivefold-eager")
    est = estimate(recipe.model, recipe.cluster, recipe.plan, options=options)
    return est.step_time_s - est.breakdown_s.get("optimizer_s", 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", help="device profiles; the first is the reference")
    parser.add_argument("--model-set", default="", metavar="K=V[,K=V]")
    parser.add_argument("--only", default="1r,1r-full,tp2-sp")
    parser.add_argument("--measured", help="a plan_vs_run.py --json file of the same layouts")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # plan_vs_run's ranks run one thread each
    values = {}
    if args.model_set:
        pairs = dict(item.split("=", 1) for item in args.model_set.split(","))
        values = {k.strip(): json.loads(v) for k, v in pairs.items()}
    layouts = [replace(layout, model_set=values) for layout in select(args.only, False)]
    measured = {}
    if args.measured:
        with open(args.measured) as f:
            measured = {r["layout"]: r for r in json.load(f)["rows"] if r["stage"] == 0}
    head = f"{'layout':<10}" + "".join(
        f" {'p' + str(i) + ' ms':>9} {'vs p0':>7}" for i in range(len(args.profiles))
    )
    print("profiles: " + ", ".join(f"p{i} = {p}" for i, p in enumerate(args.profiles)))
    print(head + (f" {'wall ms':>8} {'cpu ms':>8}  p-errors vs wall / cpu" if measured else ""))
    for layout in layouts:
        times = [predicted_step_s(layout, p) for p in args.profiles]
        line = f"{layout.name:<10}" + "".join(
            f" {t * 1e3:>9.1f} {100 * (t / times[0] - 1):>+6.1f}%" for t in times
        )
        row = measured.get(layout.name)
        if row:
            wall, cpu = row.get("measured_step_s"), row.get("measured_cpu_s")
            errs = [f"{100 * (t / wall - 1):+.0f}/{100 * (t / cpu - 1):+.0f}%" for t in times]
            line += f" {wall * 1e3:>8.1f} {cpu * 1e3:>8.1f}  " + " ".join(errs)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
