"""The `[data] sources` of a recipe: a weighted mixture of prepared shards or raw inputs.

    [data]
    tokenizer = "tokenizer.json"
    sources = [
      { name = "web", shards = "data/web", weight = 0.6 },
      { name = "books", shards = "data/books", weight = 0.15, max_epochs = 8 },
      { name = "code", inputs = ["code.jsonl"], weight = 0.25 },
    ]

Each source is `shards` (a directory from `fivefold data prepare`) or `inputs` (files tokenised
once into the cache), with a relative `weight`. `name` defaults to the directory's or first
file's name; `max_epochs` (default `fivefold.specs.mixture.EPOCH_WARN_LIMIT`) is the repetition
past which the run's start warns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.specs.mixture import EPOCH_WARN_LIMIT, weight_problems
from fivefold.specs.recipe import build

EXAMPLE = '{ name = "web", shards = "data/web", weight = 0.6 }'


@dataclass
class SourceConfig:
    """One entry of `data.sources`."""

    name: str = ""
    shards: str = ""
    inputs: list[str] = field(default_factory=list)
    weight: float = 1.0
    max_epochs: float = EPOCH_WARN_LIMIT

    @property
    def label(self) -> str:
        return self.name or Path(self.shards or (self.inputs or ["source"])[0]).name


def parse_sources(entries: list[Any], problems: list[str]) -> list[SourceConfig]:
    """`data.sources` as SourceConfigs; appends every problem (naming the source) to `problems`."""
    out: list[SourceConfig] = []
    weights: list[Any] = []
    for i, entry in enumerate(entries):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} = {entry!r}: write a table such as {EXAMPLE}.")
            continue
        fields = dict(entry)
        if "weight" not in fields:
            problems.append(f"{where}: no weight; give each source one, e.g. {EXAMPLE}.")
        weight = fields.pop("weight", 1.0)
        source = build(SourceConfig, fields, where, problems)
        if source is None:
            continue
        problems += _entry_problems(source, where)
        out.append(source)
        weights.append(weight)
    if len(out) == len(entries):
        problems += weight_problems([s.label for s in out], weights)
        for source, weight in zip(out, weights, strict=True):
            source.weight = weight
    names = [s.label for s in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        problems.append(
            f"data.sources: the name {repeated[0]!r} is used twice; give each source its own "
            "name (the summary and metrics count tokens by name)."
        )
    return out


def _entry_problems(source: SourceConfig, where: str) -> list[str]:
    label = f"{where} ({source.label!r})"
    if bool(source.shards) == bool(source.inputs):
        return [
            f"{label}: give exactly one of shards (a prepared directory) or inputs (text files), "
            f"e.g. {EXAMPLE}."
        ]
    if not source.max_epochs > 0:
        return [f"{label}: max_epochs = {source.max_epochs} must be above 0, e.g. 4."]
    return []
