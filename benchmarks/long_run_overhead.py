"""The per-step cost of loss-spike detection and straggler timing, on CPU (target: < 1 %).

Two parts, each interleaved (settings alternate round by round, so drifting machine load hits
them alike) and summarised by medians, against a baseline measured in the same run:

1. One process (`LocalRuntime`, the real loop), `train.on_spike` = off (baseline) | warn | skip,
   every step read back (`train.log_every = 1`, so warn checks every step and skip's forced
   read-back costs nothing extra): the median step time (`step_time_s` of metrics.jsonl, steps
   after the third of each run) per setting and its ratio to off.
2. Two gloo ranks (`DistributedRuntime`, ZeRO-3 data parallel), straggler timing off (baseline:
   `StragglerWatch` inactive, `WaitClock.waiting` a no-op) | on, with the all-gather at every
   step (`train.log_every = 1`, the worst case; the default is one per log step).

Beside them, the components timed alone (the median of many calls): one `SpikeDetector.check`
on a full 100-step window, one `WaitClock.waiting` around nothing (times the timed waits of a
step: the runtime's own collectives, FSDP's all-gathers and reduce-scatters). Their sum per
step over the baseline's step time is the overhead with the noise of a shared machine taken out.

    PYTHONPATH=src .venv/bin/python benchmarks/long_run_overhead.py            # ~2 min
    PYTHONPATH=src .venv/bin/python benchmarks/long_run_overhead.py --rounds 5 --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _ranks import run_ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process, as the ranks run
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
SKIP_FIRST = 3  # start-up, the measured-memory step


def overrides(name: str, root: str, steps: int) -> list[str]:
    return [
        f"train.runs_dir={root!r}",
        f"train.name={name!r}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.save_final=false",
        "train.resume=false",
        "train.progress=false",
        "train.tensorboard=false",
        "train.device=cpu",
    ]


def step_times(root: str, name: str) -> list[float]:
    lines = (Path(root) / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step_time_s"] for line in lines][SKIP_FIRST:]


def one_process(rounds: int, steps: int) -> dict[str, list[float]]:
    """Step times per `train.on_spike` setting, settings interleaved round by round."""
    import torch
    from rich.console import Console

    from fivefold.train.entry import load_run
    from fivefold.train.start import train

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"off": [], "warn": [], "skip": []}
    with tempfile.TemporaryDirectory() as root:
        for r in range(rounds):
            for policy in times:
                name = f"{policy}-{r}"
                args = [*overrides(name, root, steps), f"train.on_spike={policy!r}"]
                train(load_run(TINY, args, world_size=1), console=Console(quiet=True))
                times[policy] += step_times(root, name)
    return times


def two_ranks(rank: int, world: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """On each rank: step times with straggler timing off and on, interleaved; and the median
    time of the timing all-gather alone (`gather_s`)."""
    from rich.console import Console

    from fivefold.parallel import wait_clock
    from fivefold.train import stragglers
    from fivefold.train.entry import load_run
    from fivefold.train.runtime import distributed_runtime
    from fivefold.train.start import train

    plan = ["plan.dp_shard=2", "plan.zero=3", "plan.micro_batch=4", "plan.grad_accum=1"]
    timed_waiting = wait_clock.WaitClock.waiting
    gathering = stragglers.StragglerWatch.at_log_step
    times: dict[str, list[float]] = {"off": [], "on": []}
    waits: list[int] = []
    root = f"{tempfile.gettempdir()}/fivefold-bench-stragglers"
    for r in range(rounds):
        for setting in times:
            on = setting == "on"
            wait_clock.WaitClock.waiting = (
                timed_waiting if on else (lambda self: contextlib.nullcontext())
            )
            stragglers.StragglerWatch.at_log_step = gathering if on else (lambda self, step: [])
            name = f"{setting}-{r}"
            run = load_run(TINY, [*overrides(name, root, steps), *plan], world_size=world)
            runtime = distributed_runtime(run.recipe, run.train)
            runtime.wait_clock.take = counting(runtime.wait_clock, waits)
            train(run, runtime=runtime, console=Console(quiet=True))
            if rank == 0:
                times[setting] += step_times(root, name)
    samples = []
    for _ in range(200):  # one log step's all-gather of (compute, wait), alone
        start = time.perf_counter()
        runtime.gather_timing([0.0, 0.0])
        samples.append(time.perf_counter() - start)
    times["gather_s"] = [statistics.median(samples)]
    times["waits"] = [statistics.median(waits)]  # the runtime's own, FSDP's
    return times


def counting(clock, waits: list[int]):
    """`clock.take` that first notes how many waits it timed (log_every = 1: per step)."""
    take = clock.take

    def counted() -> float:
        waits.append(clock.waits)
        return take()

    return counted


def component_costs() -> dict[str, float]:
    """Median seconds of one spike check (full 100-step window) and one empty wait timing."""
    import torch

    from fivefold.parallel.wait_clock import WaitClock
    from fivefold.train.spikes import SpikeDetector

    detector = SpikeDetector(window=100, threshold=7.0, min_steps=20)
    for step in range(100):
        detector.check(step + 1, 3.0 + 0.01 * (step % 7), 1.0 + 0.01 * (step % 5))
    clock = WaitClock(torch.device("cpu"))

    def median_s(fn, calls: int = 2000) -> float:
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def timed_nothing() -> None:
        with clock.waiting():
            pass

    return {
        "spike_check_s": median_s(lambda: detector.check(10**6, 3.01, 1.01)),
        "wait_timing_s": median_s(timed_nothing),
    }


def report(name: str, times: dict[str, list[float]], baseline: str) -> float:
    base = statistics.median(times[baseline])
    print(f"{name}: median step time over {len(times[baseline])} steps per setting")
    for setting, values in times.items():
        median = statistics.median(values)
        print(f"  {setting:>5}: {median * 1e3:8.2f} ms  ratio {median / base:.4f}", flush=True)
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    base = report("one process, train.on_spike", one_process(args.rounds, args.steps), "off")
    ranks = run_ranks(2, two_ranks, args.rounds, args.steps, timeout_s=1800)
    gather = ranks[0].pop("gather_s")[0]
    waits = int(ranks[0].pop("waits")[0])
    base2 = report("two ranks, straggler timing", ranks[0], "off")
    costs = component_costs()
    check, wait = costs["spike_check_s"], costs["wait_timing_s"]
    print(
        f"components (medians): one spike check {check * 1e6:.1f} us = {check / base:.4%} of "
        f"the one-process step; {waits} wait timings a step {waits * wait * 1e6:.2f} us = "
        f"{waits * wait / base2:.4%} of the two-rank step; one timing all-gather (once per log "
        f"step) {gather * 1e6:.0f} us = {gather / base2:.4%} of it",
        flush=True,
    )


if __name__ == "__main__":
    main()
