"""One Python value as TOML text: what recipes and device profiles write."""

from __future__ import annotations

import json
from typing import Any


def toml_value(value: Any) -> str:
    """`value` (bool, int, float, str, list, or dict as an inline table) as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):  # JSON's string escapes are TOML's basic-string escapes
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. train.profile
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} to TOML")
