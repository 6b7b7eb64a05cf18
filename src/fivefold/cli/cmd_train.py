"""`fivefold train [recipe.toml] [section.field=value ...]`: train a model from a recipe."""

from __future__ import annotations

import argparse
import time

from fivefold.cli.intermixed import merge_intermixed
from fivefold.cli.plan_check_report import format_checks
from fivefold.errors import ConfigError
from fivefold.launch import launcher
from fivefold.parallel.device import pick_device
from fivefold.parallel.mesh import ParallelDims
from fivefold.specs.recipe import dump_recipe
from fivefold.specs.toml_text import toml_value
from fivefold.train.auto_plan import auto_plan, foreign_profile_note, run_planner_settings
from fivefold.train.entry import (
    FRESH_HELP,
    RESUME_HELP,
    check_layout,
    local_device,
    local_problems,
    resume_overrides,
    split_recipe_and_overrides,
)
from fivefold.train.prestart import memory_fit

# torch loads lazily: `fivefold --help` imports this module at start-up (cli/main.py), so
# train.start, train.summary, parallel.report and train.plan_check (all torch) are imported
# inside the functions that use them.

_DESCRIPTION = """\
Train the recipe's model on its data with the recipe's parallel plan. A recipe is a TOML file
(see configs/) with [model] (a preset and/or fields), [plan] (tp, pp, dp_replicate, dp_shard,
zero, cp, ep, micro_batch, grad_accum, recompute, precision, and the memory levers offload
(none|optimizer|all), optimizer_states (fp32|8bit|fp8; torchao) and fp8 (none|tensorwise|rowwise;
GPUs of compute capability 8.9+), see docs/memory-levers.md), [train] and [data] sections, and
optionally [cluster] (what the planner's predictions are for) and [planner] (its efficiency
profile and options, as `fivefold plan --profile`); any field can be overridden on the command
line as section.field=value.

[train] fields: name, runs_dir, run_dir, steps, stop_at, lr, min_lr, warmup_steps,
lr_schedule (cosine|linear|constant), weight_decay, betas, eps, grad_clip (0 = off),
global_batch (sequences; must equal micro_batch x dp x grad_accum), seed, device
(auto|cpu|cuda), log_every, eval_every, eval_batches, ckpt_every, save_final,
keep_checkpoints, ckpt_async, resume ("auto"|true|false), tensorboard, progress, max_time_s,
memory_step, gc_every (Python's garbage collector every N steps; 0 = automatic), compile
(torch.compile per block), profile ({start_step, steps}: a torch.profiler trace,
docs/profiling.md), trackers (["wandb", "mlflow"]), optimizer ("adamw" | "muon": Muon for the
blocks' matrices, AdamW for embeddings, head, norms; docs/internals.md) with muon_lr (0 =
lr), muon_momentum, muon_ns_steps, muon_ns_dtype (bf16|fp32), muon_adjust_lr
(match_rms_adamw: AdamW's lr carries over | original: lr about 0.02); for long runs
(docs/long-runs.md) on_spike (off|warn|skip|rollback: a loss or gradient norm above the median
of the last spike_window steps by spike_threshold robust sigmas, checked from spike_min_steps;
rollback needs ckpt_every), straggler_threshold and straggler_log_steps (a rank computing that
fraction slower than the median for that many log steps is named once).
[data] fields: shards (a prepared directory), inputs (.txt/.jsonl/.parquet/.arrow files),
tokenizer, cache_dir, val_fraction, text_field (the inputs' JSONL field or table column), or
sources (a weighted mixture: [{name, shards or inputs, weight, max_epochs}], README "Data").
Without [data] the model trains on the embedded corpus.

On CPU (or a GPU without native bf16) a recipe that does not set plan.precision trains in
fp32; a bf16 recipe runs bf16 autocast. Without [cluster] a GPU run is planned for the GPU it
finds (its catalog entry by name; an unknown one predicts memory, not time). Each run writes
runs/<name>/: metrics.jsonl (one line per step: loss, grad_norm, lr,
tokens_per_s, mfu, hfu, peak_memory_bytes, ...; on the layout-report step, plan_vs_run: the
planner's per-stage peak memory, tenant by tenant, and step time beside the measured ones),
recipe.toml (as resolved), summary.json, events.jsonl (loss spikes, rollbacks, stragglers),
skipped_batches.json (after a rollback), ckpt/step_<n>/ and TensorBoard events when
tensorboard is installed. MFU is model FLOPs against
the device's dense peak from the GPU catalog; on CPU against a matmul peak measured at start.

Re-running: by default (train.resume = "auto") a run whose directory holds a valid checkpoint
continues from the newest one; one already at train.steps says it is complete and exits 0
(raise train.steps to train further). --fresh starts over at step 0 and deletes the run's
earlier checkpoints; --resume insists on resuming and says so when there is nothing to resume.

Stopping: Ctrl-C (SIGINT) or SIGTERM stops every rank after the step it is in (on N ranks the
next step that reads values back, every train.log_every; the message names it), writes that
step's checkpoint and exits with status 128 + signal (130, 143); the same command continues. A
second signal more than 2 s later stops at once. Exit status 2: a user error (recipe, data,
checkpoint), printed once even when the ranks found it, every problem at once and a misspelt
name with the closest one; a rank that crashed: its status (for SIGKILL, whether the kernel's
out-of-memory killer did it). Exit status 75: a collective timed out or lost a rank (the message
names the step, the collective and the ranks that did not arrive); torchrun --max-restarts
restarts it. With --max-restarts the last attempt decides: 0 when it completes,
the restarts noted. Before anything starts the paths the recipe names and the predicted memory
(--dry-run's peak per rank x the local ranks) against the memory free are checked.
--dry-run prints the resolved recipe, the layout and the planner's predictions and exits; with
--nproc above 1 also `fivefold plan check`'s table, and exit status 2 when a stage could not run.
"""

_EPILOG = """\
examples:
  fivefold train configs/small-cpu.toml --fresh             # the demo (make demo), from step 0
  fivefold train configs/tiny-cpu.toml train.steps=50 plan.recompute=full
  fivefold train configs/small-cpu.toml train.steps=600     # continue a finished run further
  fivefold train configs/tiny-cpu.toml --nproc 4 plan.dp_replicate=4 plan.grad_accum=1
  fivefold train configs/tiny-cpu.toml --nproc 4 --max-restarts 3 plan.dp_shard=4 \\
      train.ckpt_every=10                                   # survives a rank's crash
  fivefold train configs/small-dp2-tp2-pp2.toml --nproc 8 --dry-run   # predict, start nothing
  python -m fivefold.train configs/tiny-cpu.toml            # the same, as one torchrun rank
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model from a TOML recipe",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Options may come before or after the recipe and overrides: everything from the first
    # positional on is re-parsed (intermixed) in `handle` by a parser with the same options.
    add_arguments(parser, items_nargs=argparse.REMAINDER)
    parser.set_defaults(handler=handle, imports=("torch", "fivefold.model"))


def add_arguments(parser: argparse.ArgumentParser, items_nargs: str = "*") -> None:
    parser.add_argument(
        "items",
        nargs=items_nargs,
        metavar="RECIPE|OVERRIDE",
        help="a recipe file (e.g. configs/small-cpu.toml; optional: without one, the defaults "
        "and overrides make the recipe) and any section.field=value overrides, values in TOML "
        "syntax (train.lr=1e-3, plan.recompute=full, train.betas=[0.9,0.99])",
    )
    parser.add_argument("--resume", action="store_true", help=RESUME_HELP)
    parser.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    parser.add_argument(
        "--steps", type=int, metavar="N", help="optimizer steps (same as train.steps=N)"
    )
    parser.add_argument(
        "--name", metavar="NAME", help="run name: output goes to runs/NAME (train.name=NAME)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="start N local processes with torchrun (the plan's degrees must multiply to N; "
        "default 1: train in this process)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="run under torchrun and restart the processes up to N times after one fails (even "
        "by SIGKILL); each restart resumes from the newest valid checkpoint (default 0)",
    )
    parser.add_argument(
        "--plan",
        choices=["recipe", "auto"],
        default="recipe",
        help="'recipe' (default) uses the recipe's [plan]; 'auto' asks the planner for the best "
        "layout of the model on N processes with the recipe's global batch",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved recipe, the layout on N processes and the planner's predicted "
        "memory per pipeline stage and step time, then exit without training",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no live progress bar (log lines only; same as train.progress=false)",
    )


def reparse_items(args: argparse.Namespace) -> argparse.Namespace:
    """Options written after the recipe: parse the remainder again, intermixed, and merge."""
    inner = argparse.ArgumentParser(
        prog="fivefold train",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(inner)
    return merge_intermixed(args, inner, "items")


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    out = resume_overrides(args.resume, args.fresh)
    if args.steps is not None:
        out.append(f"train.steps={args.steps}")
    if args.name is not None:
        out.append(f"train.name={toml_value(args.name)}")
    if args.no_progress:
        out.append("train.progress=false")
    return out


def handle(args: argparse.Namespace) -> int:
    args = reparse_items(args)
    recipe_path, overrides = split_recipe_and_overrides(args.items)
    overrides += _flag_overrides(args)
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of processes must be at least 1.")
    if args.max_restarts < 0:
        raise ConfigError(launcher.max_restarts_problems(args.max_restarts))
    if args.plan == "auto":
        chosen = auto_plan(recipe_path, overrides, args.nproc)
        print(f"--plan auto: {chosen.describe(args.nproc)}")
        overrides += chosen.overrides()
    # validate before launching (a dry run shows its predictions first, then what is wrong)
    run = check_layout(recipe_path, overrides, args.nproc, local=not args.dry_run)
    _print_planner_note(run)
    if args.dry_run:
        text, checked = dry_run_report(run, args.nproc)
        print(text)
        if problems := local_problems(run, args.nproc):
            raise ConfigError(problems)
        return 0 if checked else 2
    if args.nproc > 1 or args.max_restarts > 0:
        note = _memory_note(run, args.nproc)
        launched = launcher.launch_local(
            args.nproc, recipe_path, overrides, args.max_restarts, memory_note=note
        )
        return int(launched)
    from fivefold.train.start import train

    return train(run).exit_code  # 128 + signal number after Ctrl-C / SIGTERM, else 0


def _print_planner_note(run) -> None:
    """The recipe's [planner] table, checked; a note when it describes other software."""
    section = run.recipe.sections.get("planner")
    if section:
        settings = run_planner_settings(section, run.recipe.cluster.device, run.train.compile)
        if note := foreign_profile_note(settings):
            print(note)


def dry_run_report(run, nproc: int) -> tuple[str, bool]:
    """The resolved recipe, the layout and the planner's predictions, as `--dry-run` prints
    them (the predictions are `fivefold.parallel.report`'s, the ones each run prints), and
    whether the plan check (N > 1 processes) ran every stage."""
    from fivefold.parallel.report import predictions_for

    recipe = run.recipe
    cuda = pick_device(run.train.device).type == "cuda"
    memory, step_s, note = predictions_for(
        recipe,
        cuda,
        fsdp_wrapped=nproc > 1,
        compiled=run.train.compile,
        optimizer=run.train.optimizer,
    )
    dims = ParallelDims.from_plan(recipe.plan, nproc)
    lines = [
        dump_recipe(recipe, "Recipe as resolved (presets expanded, overrides applied).").rstrip(),
        "",
        f"layout: {recipe.plan.describe()} on {nproc} process(es): {dims.describe()}; "
        f"{run.global_batch} sequences x {recipe.model.seq_len} tokens per step",
        f"prediction ({note}):",
    ]
    for stage, gib in enumerate(memory or []):
        lines.append(f"  stage {stage}: peak memory {gib['total']:.3f} GiB per rank")
    if not memory:
        lines.append("  peak memory: not predicted")
    lines.append(
        f"  step time: {step_s:.3f} s" if step_s is not None else "  step time: not predicted"
    )
    if not run.train.ckpt_every:
        from fivefold.train.summary import checkpoint_suggestion_line

        lines.append("  " + checkpoint_suggestion_line(recipe, step_s, run.train.steps))
    checked = True
    if nproc > 1:
        table, checked = _plan_check_lines(recipe, nproc)
        lines.append(table)
    lines.append(
        "dry run: nothing started; train with the same command without --dry-run"
        if checked
        else "dry run: the plan check could not run every stage (above; exit status 2): the "
        "run's memory is unchecked, and the run may fail where the check did"
    )
    return "\n".join(lines), checked


def _memory_note(run, nproc: int) -> str:
    """The planner's predicted peak against the free memory, said if a rank is SIGKILLed."""
    fit = memory_fit(run, nproc, cuda=local_device(run.train.device).type == "cuda")
    return fit.describe() if fit is not None else ""


def _plan_check_lines(recipe, nproc: int) -> tuple[str, bool]:
    """`fivefold plan check`'s table for this layout on `nproc` ranks (fake tensors), and
    whether every stage ran."""
    from fivefold.train.plan_check import check_plan

    started = time.perf_counter()
    checks = check_plan(recipe, nproc)
    table = format_checks(recipe, nproc, checks, time.perf_counter() - started)
    return table, all(not c.problem for c in checks)
