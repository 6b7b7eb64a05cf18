"""`fivefold plan`: search the fastest layout that fits; `fivefold plan estimate`: cost one layout.

The flags are defined and parsed in `plan_args`, turned into model, cluster, layout and the
search's request in `plan_inputs` (through `fivefold.planner.request`, the front door shared
with the explorer), and printed by `plan_output`; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from fivefold.cli.plan_args import DESCRIPTION, EPILOG, add_arguments, parse_fraction
from fivefold.cli.plan_check_report import run_check
from fivefold.cli.plan_inputs import (
    batch_from_args,
    budget_from_args,
    cluster_from_args,
    layout_from_args,
    model_from_args,
    planner_from_args,
    recipe_items,
    request_from_args,
)
from fivefold.cli.plan_output import (
    SearchShown,
    budget_of,
    budget_section,
    budget_train,
    print_profile,
    print_search,
    recipe_header,
    search_json,
    summary_lines,
)
from fivefold.cli.recipe_text import data_section, train_section
from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import budget_lines
from fivefold.planner.budget.uncertainty import band_json
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.result import confidence_line, explain, slower_because
from fivefold.planner.request import resolve_headroom, resolve_request
from fivefold.planner.search.layouts import search
from fivefold.planner.step_time.muon import muon_line, muon_summary
from fivefold.specs.recipe import Recipe, dump_recipe, load_recipe


# ---- argument parsing ----------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="find the fastest parallel layout that fits, and explain it",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=_plan_handler)


def _plan_handler(args: argparse.Namespace) -> int:
    """`plan [RECIPE] ...` searches; `plan estimate [RECIPE] ...` costs one layout."""
    items = list(args.items or [])
    if items and items[0] == "estimate":
        args.items = items[1:]
        _refuse_search_flags(args)
        return _estimate_handler(args)
    if items and items[0] == "check":
        return _check_handler(items[1:], args.json)
    return _search_handler(args)


def _check_handler(items: list[str], as_json: bool) -> int:
    """`plan check RECIPE [OVERRIDE ...]`: the layout built at full scale under fake tensors."""
    if not items or "=" in items[0]:
        raise ConfigError(
            "plan check needs a recipe: fivefold plan check RECIPE.toml [section.field=value ...]"
        )
    return run_check(load_recipe(items[0], items[1:]), as_json)


def _refuse_search_flags(args: argparse.Namespace) -> None:
    """`plan estimate` costs the given layout: a search-only flag would be silently ignored."""
    given = [
        flag
        for flag, value in (
            ("--top", args.top),
            ("--risk", args.risk),
            ("--out", args.out),
            ("--batch-tolerance", args.batch_tolerance),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: only a search uses {'it' if len(given) == 1 else 'them'}; "
            "`plan estimate` costs the one layout given. Drop the flag, or run `fivefold plan` "
            "(without estimate) to search."
        )


def out_path(args: argparse.Namespace, model: Any, cluster: Any) -> Path | None:
    """Where the search writes its recipe (None without --out), checked before searching."""
    if not args.out:
        return None
    path = Path(args.out)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is a directory; name a file such as plan.toml.")
    if not parent.is_dir():
        raise ConfigError(
            f"--out {str(path)!r}: the directory {str(parent)!r} does not exist; create it or "
            "choose another path."
        )
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {str(path)!r}: {str(parent)!r} is not writable.")
    return path


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def write_recipe(
    path: Path,
    model: Any,
    cluster: Any,
    plan: Any,
    header: str,
    planner: dict[str, Any],
    compiled: bool = False,
    answer: Any = None,
) -> Path:
    """The layout as a recipe, with the [planner] table (profile and options) it was chosen by,
    [train] at its defaults (`train.compile` as planned) but for what the token budget `answer`
    (`Budget`, or None) sets (steps, checkpoint interval, checkpoints kept), and [data] at its
    defaults, written out."""
    whole = {k: _whole(v) for k, v in planner.items()}  # 10485760, not 10485760.0
    text = dump_recipe(Recipe(model, cluster, plan, {"planner": whole}), header=header)
    train = {"name": model.name} | ({"compile": True} if compiled else {})
    if whole.get("optimizer", "adamw") != "adamw":  # the optimizer the plan was priced for
        train["optimizer"] = whole["optimizer"]
    given, notes = budget_train(answer)
    run = ["", *train_section(train | given, notes), "", *data_section({})]
    text += "\n".join(run) + "\n"  # complete: `fivefold train` and `launch --slurm` take it
    try:
        path.write_text(text)
    except OSError as err:
        raise ConfigError(f"--out {str(path)!r}: cannot write the recipe ({err}).") from None
    return path


# ---- handlers ---------------------------------------------------------------------------------
def _inputs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, dict], float, Any]:
    """Model, cluster, the recipe's sections, the headroom and the planner settings.

    Headroom: --headroom when given, else the recipe's [planner] headroom, else 0.10."""
    data = recipe_items(args)
    model = model_from_args(args, data)
    cluster = cluster_from_args(args, data)
    settings = planner_from_args(args, cluster, data)
    given = None if args.headroom is None else parse_fraction(args.headroom, "--headroom")
    return model, cluster, data, resolve_headroom(given, settings), settings


def _estimate_handler(args: argparse.Namespace) -> int:
    model, cluster, data, headroom, settings = _inputs(args)
    inputs = budget_from_args(args, data)
    runtime = settings.options.fivefold_runtime
    plan = layout_from_args(args, model, cluster, data.get("plan", {}), runtime)
    est = estimate(model, cluster, plan, settings.options)
    answer = budget_of(est, inputs)
    out = est.to_json()
    out["band"] = band_json(est)
    out["budget"] = answer.to_json() if answer else None
    usable = out["hbm_gib"] * (1 - headroom)
    out["fits_with_headroom"] = out["memory_gib"]["total"] <= usable and est.host_fits
    out["headroom"] = headroom
    out["planner"] = settings.to_json()
    if settings.options.optimizer == "muon":
        out["muon"] = muon_summary(est)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{model.name} on {cluster.world_size} x {cluster.gpu}: {plan.describe()}")
    print_profile(cluster)
    print(settings.describe())
    for line in summary_lines(out, headroom):
        print(line)
    verdict = "fits" if out["fits_with_headroom"] else "DOES NOT FIT"
    print(
        f"{verdict}: worst stage {out['memory_gib']['total']:.1f} GiB against "
        f"{usable:.1f} GiB usable ({out['hbm_gib']:.0f} GiB HBM less {headroom:.0%} headroom)"
    )
    for line in budget_lines(answer) if answer else []:
        print(line)
    print(confidence_line(est))
    if muon_line(est):
        print(muon_line(est))
    return 0


def _search_handler(args: argparse.Namespace) -> int:
    model, cluster, data, headroom, settings = _inputs(args)
    inputs = budget_from_args(args, data)
    tokens, seqs = batch_from_args(args)
    path = out_path(args, model, cluster)
    request = request_from_args(args, model, cluster, data, settings, headroom, tokens, seqs)
    resolved = resolve_request(request)
    started = time.perf_counter()
    result = search(resolved.model, resolved.cluster, **resolved.search_kwargs())
    explanation = [settings.describe(), *explain(result)]
    elapsed_s = time.perf_counter() - started
    best = result.best.to_json(timeline=args.json)  # the timeline only where it is printed
    recipe_path = None
    if path is not None:
        section = settings.section(headroom) | budget_section(data)
        section |= {"tokens": inputs.tokens} if inputs else {}
        header = recipe_header(model, cluster, best) + "\n" + settings.software()
        opts = settings.options
        compiled = opts.compile and opts.fivefold_runtime  # the run compiles as planned
        answer = budget_of(result.best, inputs)
        recipe_path = write_recipe(
            path, model, cluster, result.best_plan, header, section, compiled, answer
        )
    shown = SearchShown(result, best, explanation, elapsed_s, headroom, inputs, recipe_path)
    if args.json:
        print(json.dumps(search_json(shown, settings.to_json()), indent=2))
        return 0
    comparison = None
    if "plan" in data:
        comparison = _recipe_comparison(args, model, cluster, data, result, settings.options)
    print_search(shown, comparison)
    return 0


def _recipe_comparison(
    args: argparse.Namespace, model: Any, cluster: Any, data: dict, result: Any, options: Any
) -> str:
    """One line on the recipe's own layout against the search's best."""
    try:
        plan = layout_from_args(args, model, cluster, data["plan"], options.fivefold_runtime)
        est = estimate(model, cluster, plan, options)
    except ConfigError as err:
        return f"the recipe's own layout is not valid: {err}"
    fit = "fits" if est.fits_with(result.headroom) else "does NOT fit"
    return (
        f"the recipe's layout ({plan.describe()}): {est.tokens_per_s:,.0f} tokens/s, "
        f"{est.peak_memory_bytes / 2**30:.1f} GiB, {fit}; "
        f"against the best: {slower_because(est, result.best, result.risk)}"
    )
