"""What `fivefold tune` measures and chooses: the largest micro-batch, and the cheapest recompute
policy, that fit this machine.

For each recompute policy (none, selective, full: cheapest first) real training steps run with
a growing micro-batch (1, 2, 4, ...) in one process until a step runs out of memory (CUDA) or
its measured peak exceeds the limit (any device). The peak is the runtime's own: CUDA's
allocator peak (`torch.cuda.max_memory_allocated`) or, on CPU, the live tensor storage counted
over one step (`fivefold.train.memory_counter.track_cpu_peak`, as in `fivefold train`); the
second step is measured, after the first has allocated the optimizer state. Beside each
measurement the planner's predicted peak (`fivefold.parallel.report.memory_only_prediction`).

The choice: the largest micro-batch that fits under any policy, with the cheapest policy that
reaches it (`choose`); `write_choice` puts it into the recipe file. One process only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fivefold.errors import ConfigError, WorldSizeProblem
from fivefold.specs.geometry import RECOMPUTE_POLICIES
from fivefold.units import GiB as GIB

# torch, fivefold.parallel and the loop's modules are imported inside the functions: `fivefold
# --help` imports the command module that imports this one and must stay quick and torch-free.

POLICIES = RECOMPUTE_POLICIES  # cheapest first: each recomputes more


@dataclass
class Trial:
    """One micro-batch under one policy. Bytes; `peak_bytes` (measured) None = out of memory."""

    policy: str
    micro_batch: int
    peak_bytes: int | None
    predicted: int | None
    fits: bool


def load_trial_run(recipe: str, overrides: list[str], micro_batch: int, policy: str):
    """The recipe (a `RunConfig`) at one trial: `micro_batch`, recompute `policy`, no global
    batch to match and eager blocks; ConfigError unless the plan runs on one process."""
    from fivefold.train.entry import load_run

    pinned = [
        f"plan.micro_batch={micro_batch}",
        f"plan.recompute={policy!r}",
        "train.global_batch=0",
        "train.compile=false",
    ]
    try:
        run = load_run(recipe, [*overrides, *pinned], world_size=1)
    except ConfigError as err:
        if not any(isinstance(p, WorldSizeProblem) for p in err.problems):
            raise
        problems = [p for p in err.problems if not p.startswith("this run has")]
        raise ConfigError(
            [*problems, "fivefold tune runs one process: set every plan degree to 1."]
        ) from None
    plan = run.recipe.plan
    if plan.world_size != 1:
        raise ConfigError(
            f"fivefold tune runs one process; the plan {plan.describe()} needs "
            f"{plan.world_size}: set every degree to 1 (plan.dp_shard=1 plan.tp=1 ...)."
        )
    return run


class TuneSession:
    """The recipe's model, optimizer and data, built once (from `run`, the recipe at
    micro-batch 1); each trial swaps the recompute policy on that model and draws batches of
    its micro-batch."""

    def __init__(self, recipe: str, overrides: list[str], run):
        from fivefold.train.inputs import load_train_data
        from fivefold.train.optim import build_optimizer
        from fivefold.train.runtime import LocalRuntime

        self.recipe, self.overrides = recipe, overrides
        self.runtime = LocalRuntime(run.recipe, run.train)
        self.optimizer = build_optimizer(self.runtime.model_parts, run.train, run.recipe.plan)
        self.data = load_train_data(run, 0, 1)
        self.policy = run.recipe.plan.recompute

    def run_for(self, micro_batch: int, policy: str):
        """The recipe at this trial (what the planner predicts), its policy applied to the model."""
        from fivefold.parallel.activation_checkpoint import apply_recompute, remove_recompute

        if policy != self.policy:
            remove_recompute(self.runtime.model)
            apply_recompute(self.runtime.model, policy)
            self.policy = policy
        return load_trial_run(self.recipe, self.overrides, micro_batch, policy)

    def batches(self, run):
        """Steps of `run`'s micro-batches (its micro-batch size and accumulation)."""
        data = replace(self.data, global_batch=run.global_batch)
        return data.batches(run.recipe.plan.micro_batch)


def tune_policy(
    session: TuneSession,
    policy: str,
    limit: int | None,
    max_micro_batch: int,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Micro-batches 1, 2, 4, ... under `policy` up to the first that does not fit (`limit`
    bytes; None: until out of memory); `on_trial` sees each trial as it ends."""
    trials = []
    micro_batch = 1
    while micro_batch <= max_micro_batch:
        run = session.run_for(micro_batch, policy)
        measured = measure_peak(session, run)
        fits = measured is not None and (limit is None or measured <= limit)
        trials.append(Trial(policy, micro_batch, measured, predicted_peak(run), fits))
        if on_trial is not None:
            on_trial(trials[-1])
        if not fits:
            break
        micro_batch *= 2
    return trials


def measure_peak(session: TuneSession, run) -> int | None:
    """Peak bytes of the second training step of `run` (its micro-batch and accumulation) on
    the session's model; None on CUDA out of memory (the step's tensors and gradients are
    freed before the next trial)."""
    import torch

    try:
        return second_step_peak(session, run)
    except torch.OutOfMemoryError:
        return None
    finally:
        session.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def second_step_peak(session: TuneSession, run) -> int:
    """Peak bytes of `run`'s second step on the session's model (the first allocates)."""
    import torch

    from fivefold.train.memory_counter import track_cpu_peak

    runtime, optimizer = session.runtime, session.optimizer
    batches = session.batches(run)

    def step() -> None:
        runtime.train_step(next(batches))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first trial allocates the optimizer state; each, its shapes' buffers
    if runtime.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(runtime.device)
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(runtime.device))
    with track_cpu_peak(runtime.model_parts, optimizer) as reading:
        step()
    return reading.peak_bytes


def predicted_peak(run) -> int | None:
    """The planner's peak bytes for this one-process layout (the layout report's helper)."""
    from fivefold.parallel.device import pick_device
    from fivefold.parallel.report import memory_only_prediction

    cuda = pick_device(run.train.device).type == "cuda"
    try:
        stages = memory_only_prediction(
            run.recipe.model, run.recipe.plan, fsdp_wrapped=False, cuda=cuda
        )
    except Exception:  # a planner gap must not stop the measurement
        return None
    return int(max(stage["total"] for stage in stages) * GIB)


def choose(trials: list[Trial]) -> Trial | None:
    """The largest micro-batch that fits; among policies reaching it, the cheapest."""
    fitting = [t for t in trials if t.fits]
    if not fitting:
        return None
    return max(fitting, key=lambda t: (t.micro_batch, -POLICIES.index(t.policy)))


def nothing_fits(trials: list[Trial], limit: int | None) -> str:
    """What to change when not even micro-batch 1 fits: the limit to raise, the policies left."""
    tried = sorted({t.policy for t in trials}, key=POLICIES.index)
    left = POLICIES[POLICIES.index(tried[-1]) + 1 :]  # only more recompute saves memory
    also = f"try recompute {' or '.join(left)} (--policies {','.join(left)}), " if left else ""
    also += "shorten model.seq_len or shrink the model"
    if limit is None:
        return (
            f"nothing fits: micro-batch 1 runs out of GPU memory under recompute "
            f"{', '.join(tried)}; {also}, or spread the model over more GPUs with a layout "
            "from `fivefold plan` (tune runs one process)."
        )
    least = min((t for t in trials if t.peak_bytes is not None), key=lambda t: t.peak_bytes)
    need = math.ceil(least.peak_bytes / GIB * 1000) / 1000
    return (
        f"--memory-limit {limit / GIB:.4g}: nothing fits, not even micro-batch 1; its least "
        f"measured peak is {least.peak_bytes / GIB:.3f} GiB (recompute {least.policy!r}). Raise "
        f"--memory-limit to at least {need:g}, or {also}."
    )


def write_choice(path: Path, choice: Trial) -> None:
    """Set plan.micro_batch and plan.recompute in the recipe file, keeping everything else
    (comments included); adds a [plan] table or the keys when missing."""
    text = path.read_text()
    values = {"micro_batch": str(choice.micro_batch), "recompute": f'"{choice.policy}"'}
    header = re.search(r"(?m)^\[plan\][ \t]*(#.*)?$", text)
    if header is None:
        body = "".join(f"{k} = {v}\n" for k, v in values.items())
        path.write_text(text.rstrip("\n") + f"\n\n[plan]\n{body}")
        return
    end = re.search(r"(?m)^\[", text[header.end() :])
    stop = header.end() + end.start() if end else len(text)
    section = text[header.end() : stop]
    for key, value in values.items():
        pattern = rf"(?m)^([ \t]*{key}[ \t]*=[ \t]*)([^#\n]*?)([ \t]*(#.*)?)$"
        if re.search(pattern, section):
            section = re.sub(pattern, lambda m, v=value: m.group(1) + v + m.group(3), section)
        else:
            section = f"\n{key} = {value}" + section
    path.write_text(text[: header.end()] + section + text[stop:])
