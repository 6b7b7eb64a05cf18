"""A data mixture: named sources, each with a weight, and what a token budget draws of each.

Shared by `fivefold plan` (tokens and epochs per source beside the budget) and `fivefold train`
(the same figures at a run's start, from the prepared shards' sizes). Weights are relative: they
are normalised to sum to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fivefold.errors import ConfigError

# Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (NeurIPS), sec. 5: up to
# about 4 epochs of repeated data train nearly as well as unique data; past that the value of
# more repetition falls quickly (to about zero near 16 epochs).
EPOCH_WARN_LIMIT = 4.0
EPOCH_SOURCE = "Muennighoff et al. 2023: repetition past ~4 epochs adds little"


@dataclass(frozen=True)
class SourceDraw:
    """What a budget takes from one source: `tokens` drawn, and `epochs` of its `available`
    tokens (None when its size is unknown)."""

    name: str
    weight: float  # normalised: the weights of a mixture sum to 1
    tokens: float
    available: float | None = None
    max_epochs: float = EPOCH_WARN_LIMIT

    @property
    def epochs(self) -> float | None:
        return self.tokens / self.available if self.available else None

    @property
    def repeats_too_much(self) -> bool:
        return self.epochs is not None and self.epochs > self.max_epochs

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight": self.weight,
            "tokens": self.tokens,
            "available_tokens": self.available,
            "epochs": self.epochs,
            "max_epochs": self.max_epochs,
        }


def weight_problems(names: list[str], weights: list[Any], where: str = "data.sources") -> list[str]:
    """Why `weights` (one per source `names`) are not a mixture: a weight that is not a finite
    number >= 0 (named by its source), or all of them zero."""
    out = []
    for i, (name, weight) in enumerate(zip(names, weights, strict=True)):
        ok = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight < 0:
            out.append(
                f"{where}[{i}] ({name!r}): weight = {weight!r} must be a finite number >= 0, "
                "e.g. 0.6 (weights are relative and need not sum to 1)."
            )
    if not out and weights and not any(weights):
        out.append(
            f"{where}: every weight is 0, so nothing would be drawn; give at least one source "
            "a weight above 0."
        )
    return out


def normalized(weights: list[float]) -> list[float]:
    """`weights` scaled to sum to 1 (they must pass `weight_problems`)."""
    total = math.fsum(weights)
    return [w / total for w in weights]


def draws(
    tokens: float,
    names: list[str],
    weights: list[float],
    available: list[float | None],
    max_epochs: list[float] | None = None,
) -> list[SourceDraw]:
    """Per source, the tokens a budget of `tokens` draws (its share by weight) and epochs."""
    limits = max_epochs or [EPOCH_WARN_LIMIT] * len(names)
    return [
        SourceDraw(name, w, tokens * w, size, limit)
        for name, w, size, limit in zip(names, normalized(weights), available, limits, strict=True)
    ]


def count_text(tokens: float) -> str:
    """500000000000 -> '500B', 1.5e12 -> '1.5T', 12345 -> '12,345'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if tokens >= scale:
            return f"{tokens / scale:,.4g}{suffix}"
    return f"{tokens:,.0f}"


def draw_lines(items: list[SourceDraw], indent: str = "  ") -> list[str]:
    """One line per source: weight, tokens drawn, epochs of it, and a warning past its limit."""
    out = []
    for d in items:
        epochs = f", {d.epochs:,.2f} epochs of {count_text(d.available)}" if d.epochs else ""
        unknown = "" if d.available else " (size unknown: epochs not computed)"
        line = f"{indent}{d.name}: weight {d.weight:.3f}, {count_text(d.tokens)} tokens{epochs}"
        if d.repeats_too_much:
            line += (
                f"; warning: more than {d.max_epochs:g} epochs ({EPOCH_SOURCE}); lower its "
                "weight or give it more data"
            )
        out.append(line + unknown)
    return out


Mixture = tuple[tuple[str, float, float | None], ...]  # (name, weight, available tokens or None)


def parse_mixture(entries: Any, where: str = "planner.sources") -> Mixture:
    """Tables `{ name = "web", weight = 0.6, tokens = 3e11 }` (tokens: the source's size,
    optional) as a mixture; ConfigError naming each bad entry."""
    if not isinstance(entries, list):
        raise ConfigError(f"{where} = {entries!r}: write a list of tables {_EXAMPLE}.")
    problems, out = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"name", "weight", "tokens"}:
            problems.append(f"{where}[{i}] = {entry!r}: write a table {_EXAMPLE}.")
            continue
        name, size = str(entry.get("name") or f"source{i}"), entry.get("tokens")
        if size is not None and not (_number(size) and math.isfinite(size) and size > 0):
            problems.append(f"{where}[{i}] ({name!r}): tokens = {size!r} must be a number > 0.")
        out.append((name, entry.get("weight"), float(size) if _number(size) else None))
    if not problems:
        problems += weight_problems([n for n, _, _ in out], [w for _, w, _ in out], where)
    if problems:
        raise ConfigError(problems)
    return tuple((n, float(w), t) for n, w, t in out)


_EXAMPLE = '{ name = "web", weight = 0.6, tokens = 3e11 }'


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
