"""`fivefold tune`: the largest micro-batch, and the cheapest recompute policy, that fit here.

For each recompute policy (none, selective, full: cheapest first) real training steps run with
a growing micro-batch (1, 2, 4, ...) in one process until a step runs out of memory (CUDA) or
its measured peak exceeds `--memory-limit` GiB (any device). The peak is the runtime's own:
CUDA's allocator peak (`torch.cuda.max_memory_allocated`) or, on CPU, the live tensor storage
counted over one step (`fivefold.train.memory_counter.track_cpu_peak`, as in `fivefold train`);
the second step is measured, after the first has allocated the optimizer state. Beside each
measurement the planner's predicted peak (`fivefold.parallel.report.memory_only_prediction`).

The choice: the largest micro-batch that fits under any policy, with the cheapest policy that
reaches it. `--write` puts it into the recipe file (plan.micro_batch, plan.recompute). One
process only: the plan's degrees must be 1 (multi-rank layouts are not tuned yet).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fivefold.cli.intermixed import merge_intermixed
from fivefold.errors import ConfigError, WorldSizeProblem
from fivefold.launch.threads import configure_threads
from fivefold.specs.geometry import RECOMPUTE_POLICIES
from fivefold.units import GiB as GIB

# torch, rich, fivefold.train and fivefold.parallel are imported inside the functions: `fivefold
# --help` imports every command module (fivefold.cli.main) and must stay quick and torch-free.

POLICIES = RECOMPUTE_POLICIES  # cheapest first: each recomputes more

_DESCRIPTION = """\
Find, by running real training steps on this machine, the largest micro-batch that fits the
recipe's layout and the cheapest recompute policy (none < selective < full) that reaches it.
Micro-batches 1, 2, 4, ... are tried per policy until a step runs out of GPU memory or its
measured peak exceeds --memory-limit (required on CPU). Prints the measured peak of every try
beside the planner's prediction as the try ends; the model, optimizer and data are built once
and reused by every try. --write updates plan.micro_batch and plan.recompute in the
recipe file. One process: every plan degree (dp_replicate, dp_shard, tp, pp, cp, ep) must be 1.
"""

_EPILOG = """\
examples:
  fivefold tune configs/tiny-cpu.toml --memory-limit 0.05
  fivefold tune configs/small-cpu.toml --memory-limit 2 --policies none,full --write
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="measure the largest micro-batch and cheapest recompute that fit, per policy",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="recipe TOML file")
    # REMAINDER keeps options written after an override; `_reparse` reads them (intermixed)
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="section.field=value, as for train"
    )
    _add_options(parser)
    parser.set_defaults(handler=handle, imports=("torch",))


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=0.0,
        help="GiB a step may use at its peak (required on CPU; on CUDA default: out of memory)",
    )
    parser.add_argument(
        "--max-micro-batch", type=int, default=64, help="largest micro-batch tried (64)"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="recompute policies to try, comma-separated (none,selective,full)",
    )
    parser.add_argument(
        "--write", action="store_true", help="write the choice into the recipe file"
    )


def _reparse(args: argparse.Namespace) -> argparse.Namespace:
    """Options among the overrides (`tune R plan.x=1 --memory-limit 2`): parse them, intermixed."""
    inner = argparse.ArgumentParser(prog="fivefold tune")
    inner.add_argument("overrides", nargs="*")
    _add_options(inner)
    return merge_intermixed(args, inner, "overrides")


@dataclass
class Trial:
    """One micro-batch under one policy. Bytes; `peak_bytes` (measured) None = out of memory."""

    policy: str
    micro_batch: int
    peak_bytes: int | None
    predicted: int | None
    fits: bool


def handle(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False)
    args = _reparse(args)
    policies = _policies(args.policies)
    if args.max_micro_batch < 1:
        raise ConfigError("--max-micro-batch must be at least 1.")
    if not math.isfinite(args.memory_limit) or args.memory_limit < 0:
        raise ConfigError(
            f"--memory-limit {args.memory_limit}: must be a positive number of GiB, e.g. 2."
        )
    base = _load(args.recipe, args.overrides, 1, policies[0])
    configure_threads()
    device = _device(base)
    limit = int(args.memory_limit * GIB) if args.memory_limit else None
    if limit is None and device != "cuda":
        raise ConfigError(
            "--memory-limit is required on CPU (nothing runs out of memory there first): give "
            "the GiB a step may use, e.g. --memory-limit 2."
        )
    _say(console, f"tune: building the model and data once on {device} ...")
    session = TuneSession(args.recipe, args.overrides, base)
    for line in trial_header(limit):
        _say(console, line)
    trials = []
    for policy in policies:
        trials += tune_policy(
            session,
            policy,
            limit,
            args.max_micro_batch,
            lambda t: _say(console, trial_line(t)),
        )
    choice = choose(trials)
    if choice is None:
        raise ConfigError(nothing_fits(trials, limit))
    console.print(
        f"choice: plan.micro_batch = {choice.micro_batch}, plan.recompute = "
        f"{choice.policy!r} (measured peak {choice.peak_bytes / GIB:.3f} GiB)"
    )
    if args.write:
        write_choice(Path(args.recipe), choice)
        console.print(f"wrote plan.micro_batch and plan.recompute to {args.recipe}")
        if base.train.global_batch:
            console.print(
                "note: train.global_batch is set; it must equal micro_batch x dp x grad_accum, "
                "so adjust it or plan.grad_accum"
            )
    return 0


def _say(console, line: str) -> None:
    """Print one line now (flushed: a piped stdout otherwise holds it until the end)."""
    console.print(line, markup=False)
    console.file.flush()


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


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policies {text!r}: choose among {', '.join(POLICIES)}.")
    return sorted(set(names), key=POLICIES.index)


def _load(recipe: str, overrides: list[str], micro_batch: int, policy: str):
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


def _device(run) -> str:
    from fivefold.parallel.device import pick_device

    return pick_device(run.train.device).type


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
        return _load(self.recipe, self.overrides, micro_batch, policy)

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
    """Micro-batches 1, 2, 4, ... under `policy` up to the first that does not fit; `on_trial`
    sees each trial as it ends."""
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
        return _second_step_peak(session, run)
    except torch.OutOfMemoryError:
        return None
    finally:
        session.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _second_step_peak(session: TuneSession, run) -> int:
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


def trial_header(limit: int | None) -> list[str]:
    """The two header lines of the trials' table."""
    budget = f"limit {limit / GIB:.3f} GiB" if limit else "until out of memory"
    return [
        f"measured peak per step vs planner ({budget}; GiB)",
        f"{'recompute':<10} {'micro':>5} {'measured':>9} {'planner':>9} {'error':>7}  fits",
    ]


def trial_line(t: Trial) -> str:
    """One trial's row of the table."""
    measured = "OOM" if t.peak_bytes is None else f"{t.peak_bytes / GIB:.4f}"
    predicted = "-" if t.predicted is None else f"{t.predicted / GIB:.4f}"
    error = (
        f"{100 * (t.predicted - t.peak_bytes) / t.peak_bytes:+.1f}%"
        if t.peak_bytes and t.predicted
        else "-"
    )
    return (
        f"{t.policy:<10} {t.micro_batch:>5} {measured:>9} {predicted:>9} {error:>7}  "
        f"{'yes' if t.fits else 'no'}"
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
