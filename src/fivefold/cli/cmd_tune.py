"""`fivefold tune`: parse the flags, run the trials (`fivefold.train.tune`) and print them.

What is measured and how the choice is made: `fivefold.train.tune`. One process only: the plan's
degrees must be 1 (multi-rank layouts are not tuned yet).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from fivefold.cli.intermixed import merge_intermixed
from fivefold.errors import ConfigError
from fivefold.launch.threads import configure_threads
from fivefold.train.tune import (
    GIB,
    POLICIES,
    Trial,
    TuneSession,
    choose,
    load_trial_run,
    nothing_fits,
    tune_policy,
    write_choice,
)

# rich and the device (torch) are imported inside the functions: `fivefold --help` imports every
# command module (fivefold.cli.main) and must stay quick and torch-free; fivefold.train.tune
# imports torch only inside its functions.

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
    base = load_trial_run(args.recipe, args.overrides, 1, policies[0])
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


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policies {text!r}: choose among {', '.join(POLICIES)}.")
    return sorted(set(names), key=POLICIES.index)


def _device(run) -> str:
    from fivefold.parallel.device import pick_device

    return pick_device(run.train.device).type


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
