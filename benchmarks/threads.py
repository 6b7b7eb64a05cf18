"""One process against two on the same cores: tokens/s of `fivefold train`.

Runs the small CPU recipe for a few steps three ways, each a fresh `fivefold train` process
tree, and reads the steady-state tokens/s from the run's metrics.jsonl (mean over the steps
after the first two):

- 1 process with fivefold's thread settings (threads = available cores, OMP_WAIT_POLICY
  PASSIVE unless set; `fivefold.train.threads`);
- 1 process with OpenMP's default spinning wait (OMP_WAIT_POLICY=ACTIVE), the old behaviour;
- 2 processes, TP2, one thread each (what `--nproc 2` gives on 2 cores).

The claim to check: the first is at least as fast as the third. Needs an idle machine; under
load the spinning variant collapses (measured under load: 110 tokens/s spinning against 684
passive on 2 threads, 490-618 with one thread).

    PYTHONPATH=src .venv/bin/python benchmarks/threads.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "small-cpu.toml")


def run(label: str, nproc: int, steps: int, env_extra: dict[str, str], extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env_extra}
        command = [
            sys.executable, "-m", "fivefold", "train", RECIPE, "--fresh", "--nproc", str(nproc),
            f"--steps={steps}", "train.warmup_steps=1", "train.eval_every=0",
            "train.save_final=false", "train.progress=false", "train.tensorboard=false",
            f'train.run_dir="{tmp}"', *extra,
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steady = records[2:] or records
    tokens = sum(r["tokens"] for r in steady)
    seconds = sum(r["step_time_s"] for r in steady)
    rate = tokens / seconds
    print(f"{label:<44} {rate:>10.0f} tokens/s", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.pop("OMP_WAIT_POLICY", None)
    one = run("1 process, fivefold threads (passive wait)", 1, args.steps, {}, [])
    run("1 process, spinning wait (OMP_WAIT_POLICY=ACTIVE)", 1, args.steps,
        {"OMP_WAIT_POLICY": "ACTIVE"}, [])  # fmt: skip
    two = run("2 processes, TP2, 1 thread each", 2, args.steps, {}, ["plan.tp=2"])
    print(f"1 process / 2 processes: {one / two:.2f}x (want >= 1)")


if __name__ == "__main__":
    main()
