"""Plan vs run on CPU: the planner's per-stage peak memory and step time beside what fivefold's
own runtime measures, layout by layout.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_vs_run.py [--quick] [--only NAME[,NAME]]
        [--steps 4] [--json FILE] [--list]

Each layout trains a CPU preset (fp32, the embedded corpus) for `--steps` steps on 1, 2 or 4 gloo
ranks with the real `DistributedRuntime` and the real training loop (`Trainer.fit`, clipping and
AdamW as in `fivefold train`). The figures are the runtime's own layout report
(`fivefold.parallel.report.stage_rows`): the measured peak is the loop's and the runtime's
storage counter (`fivefold.train.memory_counter`, which also sees the pipeline's receive buffers),
the prediction the planner's memory model for the recipe's model and plan; the measured step
time is the runtime's `train_step` (forward, backward, gradient communication) of step 3 (step 1
warms up; steps 2 and 4 run under the memory counters, whose dispatch mode slows every op, and
are not timed), beside the planner's `estimate()` step time less its optimizer step where the
run's cluster has a device peak ("n/a" otherwise). The measured step time is the median, over
the steps no memory counter runs on (3, 5, 6, ... with the default 8 steps), of the slowest
rank's `train_step` wall time in the stage: a single step swings by 10-30 % on a 2-core machine
(a gloo collective stalls for 3-4 ms about one call in twenty). Memory is deterministic; step
times depend on the machine and its load.

Prints one row per (layout, pipeline stage) with the errors (predicted / measured - 1) and the
mean and worst absolute error; `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta

SMALL = "small"
TINY_MOE = "tiny-moe"


@dataclass(frozen=True)
class Layout:
    """One run: `plan` overrides on top of fp32, micro-batch 2, accumulation 1."""

    name: str
    plan: dict = field(default_factory=dict)
    model: str = SMALL
    model_set: dict = field(default_factory=dict)  # model.FIELD overrides on the preset

    @property
    def full_plan(self) -> dict:
        return {"precision": "fp32", "micro_batch": 2, "grad_accum": 1, **self.plan}

    @property
    def world(self) -> int:
        p = self.full_plan
        dp = p.get("dp_replicate", 1) * p.get("dp_shard", 1)
        return p.get("pp", 1) * dp * p.get("cp", 1) * p.get("tp", 1)


def _pp(schedule: str, **extra) -> dict:
    vpp = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    return {"pp": 2, "vpp": vpp, "schedule": schedule, "micro_batch": 1, "grad_accum": 4, **extra}


LAYOUTS = [
    Layout("1r", {}),
    Layout("1r-mbs1-accum2", {"micro_batch": 1, "grad_accum": 2}),
    Layout("1r-selective", {"recompute": "selective"}),
    Layout("1r-full", {"recompute": "full"}),
    Layout("dp2-zero0", {"dp_replicate": 2, "micro_batch": 1}),
    Layout("dp2-zero1", {"dp_shard": 2, "zero": 1, "micro_batch": 1}),
    Layout("dp2-zero2-accum2", {"dp_shard": 2, "zero": 2, "micro_batch": 1, "grad_accum": 2}),
    Layout("dp2-zero3", {"dp_shard": 2, "zero": 3, "micro_batch": 1}),
    Layout("dp2-zero3-accum2", {"dp_shard": 2, "zero": 3, "micro_batch": 1, "grad_accum": 2}),
    Layout("hsdp2x2", {"dp_replicate": 2, "dp_shard": 2, "zero": 3, "micro_batch": 1}),
    Layout("tp2-sp", {"tp": 2}),
    Layout("pp2-gpipe", _pp("gpipe")),
    Layout("pp2-1f1b", _pp("1f1b")),
    Layout("pp2-interleaved", _pp("interleaved-1f1b")),
    Layout("pp2-zbv", _pp("zbv")),
    Layout("pp2-dualpipev", _pp("dualpipev")),
    Layout("cp2-ring", {"cp": 2}),
    Layout("tp2-pp2-1f1b", {"tp": 2, **_pp("1f1b")}),
    Layout("pp2-zero3-dp2", {"dp_shard": 2, "zero": 3, **_pp("1f1b")}),
    Layout("1r-8bit-states", {"optimizer_states": "8bit"}),
    Layout(
        "dp2-zero1-offload-opt",
        {"dp_shard": 2, "zero": 1, "micro_batch": 1, "offload": "optimizer"},
    ),
    Layout("dp2-zero3-offload-all", {"dp_shard": 2, "zero": 3, "micro_batch": 1, "offload": "all"}),
    Layout("moe-1r", {}, TINY_MOE),
    Layout("moe-ep2", {"dp_shard": 2, "zero": 1, "ep": 2, "micro_batch": 1}, TINY_MOE),
]
QUICK = ("1r", "dp2-zero3-accum2", "tp2-sp", "pp2-1f1b")


# ---- one rank ---------------------------------------------------------------------------------
def _overrides(layout: Layout, steps: int, run_dir: str) -> list[str]:
    train = {
        "steps": steps,
        "warmup_steps": 1,
        "device": "cpu",
        "run_dir": run_dir,
        "save_final": False,
        "tensorboard": False,
        "progress": False,
        "eval_every": 0,
        "resume": False,
    }
    items = [f"model.preset={json.dumps(layout.model)}"]
    items += [f"model.{k}={json.dumps(v)}" for k, v in layout.model_set.items()]
    items += [f"plan.{k}={json.dumps(v)}" for k, v in layout.full_plan.items()]
    items += [f"train.{k}={json.dumps(v)}" for k, v in train.items()]
    return items


def run_layout(layout: Layout, steps: int, run_dir: str) -> dict | None:
    """Train `layout` on this rank (inside a process group) and return rank 0's report rows."""
    from rich.console import Console

    from fivefold.parallel.distributed_runtime import DistributedRuntime
    from fivefold.parallel.report import stage_rows
    from fivefold.train.entry import load_run
    from fivefold.train.loop import Trainer

    run = load_run(None, _overrides(layout, steps, run_dir), world_size=layout.world)
    quiet = io.StringIO()
    stdout, sys.stdout = sys.stdout, quiet  # the runtime prints its own report on rank 0
    try:
        runtime = DistributedRuntime(run.recipe, run.train)
        wall_s, cpu_s = _time_steps(runtime)
        Trainer(run, runtime, Console(file=quiet)).fit()
        result = stage_rows(runtime)
    finally:
        sys.stdout = stdout
    mine = {
        "pp": runtime.pp_rank,
        "cpu_s": cpu_s[TIMED_STEP - 1] if len(cpu_s) >= TIMED_STEP else None,
        "wall_s": [t for i, t in enumerate(wall_s, 1) if i not in UNTIMED_STEPS],
    }
    if result is None:
        return {"cpu": mine}
    rows, note = result
    return {
        "layout": layout.name,
        "describe": run.recipe.plan.describe(),
        "rows": rows,
        "note": note,
        "cpu": mine,
    }


TIMED_STEP = 3  # the step the runtime times (1 warms up, 2 and 4 count memory)
UNTIMED_STEPS = (1, 2, 4)


def _time_steps(runtime) -> tuple[list[float], list[float]]:
    """Record the wall seconds and this process's CPU seconds (all its threads: compute and
    gloo's; under load, what a step costs this rank, waits for its peers excluded) of every
    `train_step`."""
    wall: list[float] = []
    cpu: list[float] = []
    step = runtime.train_step

    def timed(micro_batches):
        tick, cpu_tick = time.perf_counter(), time.process_time()
        try:
            return step(micro_batches)
        finally:
            wall.append(time.perf_counter() - tick)
            cpu.append(time.process_time() - cpu_tick)

    runtime.train_step = timed
    return wall, cpu


def _worker(
    rank: int,
    world: int,
    store: str,
    results,
    layout: Layout,
    steps: int,
    tmp: str,
    keep_memory: bool = True,
):
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        from fivefold.launch.host_memory import keep_freed_memory

        torch.set_num_threads(1)
        if keep_memory:
            keep_freed_memory()  # as `fivefold train` does
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
        payload = run_layout(layout, steps, tmp)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    os._exit(0)  # a normal exit can abort in gloo's destructors


def measure(layout: Layout, steps: int, timeout_s: float = 900.0, keep_memory: bool = True) -> dict:
    """Run `layout` on its ranks (forked from a torch-preloaded forkserver); rank 0's rows.
    `keep_memory`: the ranks keep freed host memory as `fivefold train` does
    (`fivefold.launch.host_memory`; False for `benchmarks/host_memory.py`'s baseline)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "fivefold.parallel.distributed_runtime", "fivefold.train.loop"]
    )
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fivefold-pvr-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    layout.world,
                    store,
                    results,
                    layout,
                    steps,
                    os.path.join(tmp, "run"),
                    keep_memory,
                ),
                daemon=True,
            )
            for r in range(layout.world)
        ]
        for p in procs:
            p.start()
        done, report, cpu = 0, None, []
        deadline = time.monotonic() + timeout_s
        try:
            while done < layout.world:
                try:
                    rank, status, payload = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"{layout.name}: ranks died or timed out") from None
                    continue
                if status == "error":
                    raise RuntimeError(f"{layout.name}: rank {rank} failed:\n{payload}")
                done += 1
                cpu.append(payload["cpu"])
                report = payload if rank == 0 else report
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert report is not None
    for row in report["rows"]:  # the busiest rank of each stage
        stage = [c for c in cpu if c["pp"] == row["stage"]]
        cpus = [c["cpu_s"] for c in stage if c["cpu_s"] is not None]
        row["measured_cpu_s"] = max(cpus) if cpus else None
        steps = [max(per_step) for per_step in zip(*(c["wall_s"] for c in stage), strict=True)]
        if steps:
            row["measured_step_s"] = statistics.median(steps)
    return report


# ---- the table --------------------------------------------------------------------------------
def error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1, or None when either is unknown."""
    if not predicted or not measured:
        return None
    return predicted / measured - 1.0


def flatten(reports: list[dict]) -> list[dict]:
    out = []
    for report in reports:
        for row in report["rows"]:
            out.append(
                {
                    "layout": report["layout"],
                    "stage": row["stage"],
                    "ranks": row["ranks"],
                    "predicted_peak_bytes": row["predicted_peak_bytes"],
                    "measured_peak_bytes": row["measured_peak_bytes"],
                    "memory_error": error(row["predicted_peak_bytes"], row["measured_peak_bytes"]),
                    "predicted_step_s": row["predicted_step_s"],
                    "measured_step_s": row["measured_step_s"],
                    "step_error": error(row["predicted_step_s"], row["measured_step_s"]),
                    "measured_cpu_s": row.get("measured_cpu_s"),
                    "cpu_error": error(row["predicted_step_s"], row.get("measured_cpu_s")),
                    "predicted_tenants": row.get("predicted_tenants", {}),
                    "measured_tenants": row.get("measured_tenants", {}),
                }
            )
    return out


def _mib(value: float | None) -> str:
    return f"{value / 2**20:9.1f}" if value else f"{'n/a':>9}"


def _ms(value: float | None) -> str:
    return f"{value * 1e3:9.1f}" if value else f"{'n/a':>9}"


def _pct(value: float | None) -> str:
    return f"{value * 100:+7.1f}%" if value is not None else f"{'n/a':>8}"


def summary(rows: list[dict], key: str) -> str:
    errors = [abs(r[key]) for r in rows if r[key] is not None]
    if not errors:
        return "n/a"
    worst = max(rows, key=lambda r: abs(r[key]) if r[key] is not None else -1)
    return (
        f"mean |error| {100 * sum(errors) / len(errors):.1f}%, worst {100 * max(errors):.1f}% "
        f"({worst['layout']} stage {worst['stage']}) over {len(errors)} rows"
    )


def table(rows: list[dict]) -> str:
    lines = [
        f"{'layout':<18} {'stage':>5} {'pred MiB':>9} {'meas MiB':>9} {'error':>8}   "
        f"{'pred ms':>9} {'meas ms':>9} {'error':>8}   {'cpu ms':>9} {'error':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['layout']:<18} {r['stage']:>5} {_mib(r['predicted_peak_bytes'])} "
            f"{_mib(r['measured_peak_bytes'])} {_pct(r['memory_error'])}   "
            f"{_ms(r['predicted_step_s'])} {_ms(r['measured_step_s'])} {_pct(r['step_error'])}   "
            f"{_ms(r['measured_cpu_s'])} {_pct(r['cpu_error'])}"
        )
    lines.append(f"peak memory: {summary(rows, 'memory_error')}")
    lines.append(f"step time:   {summary(rows, 'step_error')}")
    lines.append(f"cpu time:    {summary(rows, 'cpu_error')} (a loaded machine's proxy)")
    return "\n".join(lines)


def tenant_table(rows: list[dict]) -> str:
    """Predicted / measured MiB per tenant (activations include the planner's buffers)."""
    names = ("params", "grads", "optimizer", "activations", "params+grads+activations")
    lines = [f"{'layout':<18} {'stage':>5} " + " ".join(f"{n[:19]:>19}" for n in names)]
    for r in rows:
        # Multi-process rows compare the optimizer and one sum (parallel.report.WRAPPED_GROUPS).
        pred, meas = r["predicted_tenants"], r["measured_tenants"]
        cells = [
            f"{pred[n] / 2**20:8.1f} / {meas[n] / 2**20:8.1f}"
            if n in meas and n in pred
            else f"{'n/a':>8} / {'n/a':>8}"
            for n in names
        ]
        lines.append(f"{r['layout']:<18} {r['stage']:>5} " + " ".join(cells))
    return "\n".join(lines)


def select(only: str | None, quick: bool) -> list[Layout]:
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {layout.name for layout in LAYOUTS}]
        if unknown:
            raise SystemExit(
                f"--only: unknown layout(s) {', '.join(unknown)}; see --list for the names."
            )
        return [layout for layout in LAYOUTS if layout.name in names]
    if quick:
        return [layout for layout in LAYOUTS if layout.name in QUICK]
    return list(LAYOUTS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated layout names (see --list)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument(
        "--steps", type=int, default=8, help="training steps per layout (>= 4; 8 times five)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument(
        "--tenants", action="store_true", help="also print predicted / measured MiB per tenant"
    )
    parser.add_argument(
        "--model-set",
        default="",
        metavar="K=V[,K=V]",
        help="model fields over each layout's preset, e.g. layers=4,hidden=384,heads=6,"
        "kv_heads=2,ffn=1024 (a model the device profile was not measured on)",
    )
    parser.add_argument("--list", action="store_true", help="list the layouts and exit")
    args = parser.parse_args(argv)
    layouts = select(args.only, args.quick)
    if args.model_set:
        pairs = dict(item.split("=", 1) for item in args.model_set.split(","))
        values = {k.strip(): json.loads(v) for k, v in pairs.items()}
        layouts = [replace(layout, model_set=values) for layout in layouts]
    if args.list:
        for layout in layouts:
            print(f"{layout.name:<18} {layout.world} rank(s)  {layout.model}  {layout.full_plan}")
        return 0
    if args.steps < 4:
        parser.error(
            "--steps must be >= 4: step 1 is the warm-up, steps 2 and 4 count memory (which "
            "slows them), step 3 is timed"
        )
    reports = []
    for layout in layouts:
        started = time.perf_counter()
        report = measure(layout, args.steps)
        reports.append(report)
        print(
            f"# {layout.name}: {report['describe']} ({layout.world} rank(s), "
            f"{time.perf_counter() - started:.0f} s; {report['note']})",
            flush=True,
        )
    rows = flatten(reports)
    print(table(rows))
    if args.tenants:
        print(tenant_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"layouts": reports, "rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
