"""The `[train]`, `[data]` and batch lines of the recipes fivefold writes (`plan --out`,
`import --hf`), every default written out with what it means, so a written recipe runs as it
says and shows what to change.

The comments are the ones beside each field in `TrainConfig`, `DataConfig` and `ParallelPlan`
(read from their source), so they are written once.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from functools import cache
from typing import Any

from fivefold.specs.plan import ParallelPlan
from fivefold.specs.toml_text import toml_value as write_toml_value

# fivefold.train.config (numpy, rich) is imported inside the functions: `fivefold --help`
# imports every command module (fivefold.cli.main) and must stay quick.

# The [train] fields a written recipe spells out (the rest keep their defaults silently).
TRAIN_FIELDS = (
    "name",
    "steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "lr_schedule",
    "weight_decay",
    "grad_clip",
    "seed",
    "eval_every",
    "ckpt_every",
    "keep_checkpoints",
)
BATCH_FIELDS = ("micro_batch", "grad_accum")
_FIELD_LINE = re.compile(r"^\s+(\w+): [^=]+= .*?  # (.*)$")


@cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: the comment beside it in `cls`'s source} (empty where the source has none)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = (_FIELD_LINE.match(line) for line in source.splitlines())
    return {m.group(1): m.group(2) for m in found if m}


def toml_value(value: Any) -> str:
    """A TOML literal for a recipe value; anything not plain (a path, an enum) as its text."""
    plain = isinstance(value, bool | int | float | str | list | dict)
    return write_toml_value(value if plain else str(value))


def commented_lines(
    cls: type, names: tuple[str, ...], given: dict[str, Any], notes: dict[str, str] | None = None
) -> list[str]:
    """`name = value  # comment` for `given` (as written; its comment `notes[name]` where
    given) and then `names` not given, at the dataclass's defaults, marked "default:"."""
    defaults = {f.name: f for f in fields(cls)}
    comments = field_comments(cls)
    lines = []
    for name in [*given, *(n for n in names if n not in given)]:
        if name in given:
            value, mark = given[name], ""
        else:
            spec = defaults[name]
            value = spec.default_factory() if callable(spec.default_factory) else spec.default
            mark = "default: "
        comment = (notes or {}).get(name) or comments.get(name, "")
        note = f"  # {mark}{comment}".rstrip() if mark or comment else ""
        lines.append(f"{name} = {toml_value(value)}{note}")
    return lines


def train_section(given: dict[str, Any], notes: dict[str, str] | None = None) -> list[str]:
    """The [train] table: `given` first (commented by `notes` where given), then the usual
    settings at their defaults."""
    from fivefold.train.config import TrainConfig

    return ["[train]", *commented_lines(TrainConfig, TRAIN_FIELDS, given, notes)]


def data_section(given: dict[str, Any]) -> list[str]:
    """The [data] table: `given`, or a note that the run trains on the embedded corpus."""
    from fivefold.train.config import DataConfig

    lines = ["[data]"]
    if not {"shards", "inputs"} & set(given):
        lines.append(
            '# shards = "DIR"  # token shards from `fivefold data prepare`; as written, the '
            "run trains on the embedded corpus (the default)"
        )
    return lines + commented_lines(DataConfig, ("val_fraction",), given)


def batch_lines(given: dict[str, Any]) -> list[str]:
    """[plan] lines for the batch: micro_batch and grad_accum, written out with their meaning."""
    return commented_lines(ParallelPlan, BATCH_FIELDS, given)
