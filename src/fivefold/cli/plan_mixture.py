"""The data mixture `fivefold plan` prices beside its token budget: `--source` flags, else the
recipe's `[planner] sources` (read by `planner.budget.token_budget.budget_inputs`), else its
`[data] sources` with each prepared source's size read from its shards' manifest."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from pathlib import Path
from typing import Any

from fivefold.cli.plan_args import parse_tokens
from fivefold.errors import ConfigError
from fivefold.specs.mixture import Mixture, parse_mixture

SOURCE_FLAG = re.compile(r"([^=:]+)=([^:]+)(?::(.+))?")


def plan_mixture(args: argparse.Namespace, recipe_data: dict[str, Any]) -> Mixture | None:
    """The mixture to price, or None (then [planner] sources, if any, apply)."""
    flags = getattr(args, "source", None) or []
    if flags:
        return parse_mixture([_source_flag(text) for text in flags], "--source")
    planner = recipe_data.get("planner")
    if isinstance(planner, dict) and planner.get("sources") is not None:
        return None
    data = recipe_data.get("data")
    entries = data.get("sources") if isinstance(data, dict) else None
    if not entries or not isinstance(entries, list):
        return None
    return parse_mixture([_data_source(i, e) for i, e in enumerate(entries)], "data.sources")


def _source_flag(text: str) -> dict[str, Any]:
    match = SOURCE_FLAG.fullmatch(text.strip())
    if not match:
        raise ConfigError(
            f"--source {text!r}: write NAME=WEIGHT or NAME=WEIGHT:TOKENS, e.g. web=0.6:300B."
        )
    name, weight, tokens = match.groups()
    try:
        value = float(weight)
    except ValueError:
        raise ConfigError(f"--source {text!r}: the weight {weight!r} is not a number.") from None
    entry = {"name": name, "weight": value}
    return entry | ({"tokens": parse_tokens(tokens, f"--source {name}")} if tokens else {})


def _data_source(index: int, entry: Any) -> Any:
    """A `[data] sources` entry as a mixture table, its size from its shards when prepared."""
    if not isinstance(entry, dict):
        return entry
    shards = entry.get("shards") or ""
    name = entry.get("name") or Path(shards or (entry.get("inputs") or [""])[0]).name
    out = {"name": name or f"source{index}", "weight": entry.get("weight")}
    manifest = Path(shards) / "manifest.json" if shards else None
    if manifest is not None and manifest.is_file():
        # an unreadable manifest: size unknown here (training reports the problem)
        with contextlib.suppress(ValueError, KeyError, OSError):
            out["tokens"] = json.loads(manifest.read_text())["num_tokens"]
    return out
