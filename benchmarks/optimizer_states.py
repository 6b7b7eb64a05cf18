"""fp32 AdamW against torchao's 8-bit and FP8 Adam states (`plan.optimizer_states`) on CPU.

Each run trains a CPU preset (default `tiny`, 300 steps) with the real training loop (`Trainer`
over `LocalRuntime`, the embedded corpus, lr 3e-3 with 10 warmup steps and cosine decay), from
the same seed, so the weights start equal and every run sees the same batches in the same
order; only the optimizer's m and v differ. Printed per setting: the final loss, its difference
from fp32 (final step, and the largest over the last 50 steps), the mean of the last 50 losses,
and the optimizer state bytes measured on the optimizer's tensors (codes, block scales and
quantisation maps included) against `fivefold.parallel.lowbit.adam_state_bytes`, the per-tensor
rule the runtime's memory report uses (8 bytes per element for fp32 m and v; 2 bytes plus two
fp32 scales per 256-element block for 8-bit/FP8, and the 8-bit code's 256-entry map per
state; tensors under 4096 elements stay fp32), and per parameter against the planner's
`2 * fivefold.planner.memory.levers.moment_bytes(states)` (which counts every parameter as quantised
and leaves out the maps, so it is a little lower on a model as small as `tiny`).

    PYTHONPATH=src .venv/bin/python benchmarks/optimizer_states.py             # tiny, 300 steps
    PYTHONPATH=src .venv/bin/python benchmarks/optimizer_states.py --preset small --steps 200

The first 8-bit/FP8 step compiles torchao's update per parameter shape (needs g++); times are
not the point here and are not printed.
"""

from __future__ import annotations

import argparse
import json
import tempfile

STATES = ("fp32", "8bit", "fp8")
TAIL = 50  # the last steps compared


def recipe_for(preset: str, steps: int, states: str, run_dir: str):
    from fivefold.train.entry import load_run

    overrides = [
        f"model.preset={preset}",
        "plan.micro_batch=4",
        "plan.grad_accum=2",
        "plan.precision=fp32",
        f"plan.optimizer_states={states}",
        f"train.steps={steps}",
        "train.lr=3e-3",
        "train.min_lr=3e-4",
        "train.warmup_steps=10",
        "train.seed=0",
        "train.device=cpu",
        "train.save_final=false",
        "train.progress=false",
        "train.tensorboard=false",
        f"train.run_dir={run_dir}",
        "train.resume=false",
    ]
    return load_run(None, overrides, world_size=1)


def train(preset: str, steps: int, states: str) -> dict:
    """Losses of every step and the optimizer's measured and expected state bytes."""
    from rich.console import Console

    from fivefold.parallel.lowbit import adam_state_bytes, state_bytes
    from fivefold.planner.memory.levers import moment_bytes
    from fivefold.train.loop import Trainer
    from fivefold.train.runtime import LocalRuntime

    with tempfile.TemporaryDirectory(prefix="fivefold-optim-") as run_dir:
        run = recipe_for(preset, steps, states, run_dir)
        runtime = LocalRuntime(run.recipe, run.train)
        trainer = Trainer(run, runtime, Console(quiet=True))
        trainer.prepare_run_dir()
        summary = trainer.fit()
        params = [p for p in runtime.model.parameters()]
        return {
            "states": states,
            "losses": summary.losses,
            "state_bytes": state_bytes(trainer.optimizer),
            "expected_bytes": int(sum(adam_state_bytes(p.numel(), states) for p in params)),
            "params": sum(p.numel() for p in params),
            "planner_bytes_per_param": 2 * moment_bytes(states),
        }


def compare(reference: dict, other: dict, tail: int = TAIL) -> dict:
    """Loss differences of `other` from `reference` (same steps): final and max over the tail."""
    pairs = list(zip(reference["losses"], other["losses"], strict=True))
    return {
        "final_diff": other["losses"][-1] - reference["losses"][-1],
        "tail_max_abs_diff": max(abs(b - a) for a, b in pairs[-tail:]),
        "tail_mean": sum(b for _, b in pairs[-tail:]) / len(pairs[-tail:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--states", nargs="+", default=list(STATES), choices=STATES)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    runs = {s: train(args.preset, args.steps, s) for s in dict.fromkeys(["fp32", *args.states])}
    reference = runs["fp32"]
    tail = min(TAIL, args.steps)
    print(
        f"{args.preset}, {args.steps} steps, {reference['params']:,} parameters; differences "
        f"against fp32 AdamW (final step, max over the last {tail})"
    )
    print(
        f"{'states':<6} {'final loss':>10} {'diff':>9} {'max|diff|':>9} {'tail mean':>9} "
        f"{'state bytes':>12} {'B/param':>7} {'rule':>12} {'planner B/param':>15}"
    )
    rows = []
    for states, run in runs.items():
        diff = compare(reference, run, tail)
        rows.append({"states": states, **diff, **{k: v for k, v in run.items() if k != "losses"}})
        print(
            f"{states:<6} {run['losses'][-1]:>10.4f} {diff['final_diff']:>+9.4f} "
            f"{diff['tail_max_abs_diff']:>9.4f} {diff['tail_mean']:>9.4f} "
            f"{run['state_bytes']:>12,} {run['state_bytes'] / run['params']:>7.2f} "
            f"{run['expected_bytes']:>12,} {run['planner_bytes_per_param']:>15.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "losses": {s: r["losses"] for s, r in runs.items()}}, f)


if __name__ == "__main__":
    main()
