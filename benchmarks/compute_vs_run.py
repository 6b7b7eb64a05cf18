"""The planner's step time on a calibrated CPU against real one-process training steps, timed on
the thread's CPU clock (what the step costs, however busy the machine is).

    fivefold calibrate plan.micro_batch=2 --out /tmp/profile.toml
    PYTHONPATH=src .venv/bin/python benchmarks/compute_vs_run.py /tmp/profile.toml [--model small]

One process, one thread (so the step runs on the timed thread and the thread CPU clock equals the
wall time of an idle machine), fp32, the embedded corpus; per layout `--steps` steps of the
loop's own `train_one_step` (forward, backward, clipping, AdamW), the first one dropped, the
lower median of the rest against `estimate().step_time_s` for the recipe with the profile as
its cluster. Multi-rank layouts (communication, pipeline bubbles) are `plan_vs_run.py`'s, on an
idle machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # torch is imported later: one thread, the one timed

LAYOUTS = [
    {"micro_batch": 2, "grad_accum": 1},
    {"micro_batch": 1, "grad_accum": 2},
    {"micro_batch": 2, "grad_accum": 1, "recompute": "selective"},
    {"micro_batch": 2, "grad_accum": 1, "recompute": "full"},
    {"micro_batch": 6, "grad_accum": 2},
]


def measure(profile: str, model: str, plan: dict, steps: int, run_dir: str) -> tuple[float, float]:
    """(predicted, measured) seconds per step of `plan` for `model` on one thread."""
    import torch
    from rich.console import Console

    from fivefold.planner.estimate import estimate
    from fivefold.train.entry import load_run
    from fivefold.train.loop import Trainer
    from fivefold.train.runtime import make_runtime

    torch.set_num_threads(1)
    items = [f"model.preset={json.dumps(model)}", f"cluster.profile={json.dumps(profile)}"]
    items += ['plan.precision="fp32"', 'train.device="cpu"', f"train.run_dir={json.dumps(run_dir)}"]
    items += [f"plan.{k}={json.dumps(v)}" for k, v in plan.items()]
    items += [f"train.steps={steps}", "train.warmup_steps=1", "train.eval_every=0"]
    items += ["train.save_final=false", "train.resume=false", "train.progress=false"]
    run = load_run(None, items, world_size=1)
    runtime = make_runtime(run.recipe, run.train)
    try:
        trainer = Trainer(run, runtime, Console(file=io.StringIO()))
        batches = trainer.data.batches(run.recipe.plan.micro_batch)
        seconds = []
        for _ in range(steps):
            micro_batches = next(batches)
            tick = time.thread_time()
            trainer.train_one_step(micro_batches)
            seconds.append(time.thread_time() - tick)
    finally:
        runtime.close()
    rest = sorted(seconds[1:])
    predicted = estimate(run.recipe.model, run.recipe.cluster, run.recipe.plan).step_time_s
    return predicted, rest[(len(rest) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a device profile written by `fivefold calibrate`")
    parser.add_argument("--model", default="small", help="model preset (default small)")
    parser.add_argument("--steps", type=int, default=5, help="steps per layout (>= 3)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step is dropped)")
    import tempfile

    errors = []
    print(f"{'layout':<62} {'pred ms':>9} {'meas ms':>9} {'error':>8}")
    with tempfile.TemporaryDirectory(prefix="fivefold-cvr-") as tmp:
        for plan in LAYOUTS:
            predicted, measured = measure(args.profile, args.model, plan, args.steps, tmp)
            errors.append(predicted / measured - 1)
            print(
                f"{json.dumps(plan):<62} {predicted * 1e3:9.1f} {measured * 1e3:9.1f} "
                f"{errors[-1] * 100:+7.1f}%",
                flush=True,
            )
    worst = max(abs(e) for e in errors)
    print(f"step time: mean |error| {100 * sum(map(abs, errors)) / len(errors):.1f}%, worst "
          f"{100 * worst:.1f}% over {len(errors)} layouts")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
