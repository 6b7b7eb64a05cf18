"""TOML recipes: `[model]`, `[cluster]`, `[plan]`; free sections `[train]`, `[data]`, `[planner]`.

A recipe may name presets (`[model] preset = "small"`, `[cluster] preset = "dgx-h100"` with
`gpus = 64`, or a measured machine: `[cluster] profile = "device-profile.toml"`, whose local
ranks default to the run's processes) and override any field. Command-line overrides are
`section.field=value` with the value parsed as a TOML literal (`plan.tp=2`, `train.lr=3e-4`,
`model.mlp=gelu`); a bare word that is not a TOML literal is taken as a string.
Every problem is reported at once. The free sections are validated by the layer that reads
them: `[train]` and `[data]` by `fivefold.train.config`, `[planner]` (the efficiency profile,
the planner's options and the search's headroom) by `fivefold.planner.frameworks.planner_settings`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fivefold.errors import ConfigError
from fivefold.specs.cluster import (
    CLUSTER_PRESETS,
    ClusterSpec,
    cluster_preset,
    node_split,
    profile_cluster,
)
from fivefold.specs.geometry import RECOMPUTE_POLICIES
from fivefold.specs.hf_config import read_hf_config, spec_from_hf_config
from fivefold.specs.model import MLP_KINDS, ModelSpec, default_ffn
from fivefold.specs.plan import (
    CP_KINDS,
    FP8_RECIPES,
    OFFLOAD_KINDS,
    OPTIMIZER_STATES,
    SCHEDULES,
    ParallelPlan,
)
from fivefold.specs.precision import RECIPES
from fivefold.specs.presets import MODEL_PRESETS
from fivefold.specs.toml_text import toml_value

T = TypeVar("T")

# Fields with a fixed set of values: a value of the wrong type is told the choices too.
FIELD_CHOICES: dict[str, tuple[Any, ...]] = {
    "model.mlp": MLP_KINDS,
    "plan.schedule": SCHEDULES,
    "plan.cp_kind": CP_KINDS,
    "plan.zero": (0, 1, 2, 3),
    "plan.recompute": RECOMPUTE_POLICIES,
    "plan.precision": tuple(RECIPES),
    "plan.offload": OFFLOAD_KINDS,
    "plan.optimizer_states": OPTIMIZER_STATES,
    "plan.fp8": FP8_RECIPES,
}
_CORE_SECTIONS = ("model", "cluster", "plan")
SECTIONS = (*_CORE_SECTIONS, "train", "data", "planner")  # free sections: module docstring


@dataclass
class Recipe:
    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # train, data, ...

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name, {}))


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["plan.tp=2", "train.lr=1e-3"]` -> `{"plan": {"tp": 2}, "train": {"lr": 0.001}}`."""
    out: dict[str, dict[str, Any]] = {}
    bad = []
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            bad.append(
                f"override {item!r}: write it as section.field=value, e.g. plan.tp=2 or "
                "train.steps=100."
            )
            continue
        out.setdefault(section, {})[name] = _literal(raw.strip())
    if bad:
        raise ConfigError(bad)
    return out


def _literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe file {str(p)!r} does not exist; check the path (see configs/).")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe file {str(p)!r} is not valid TOML: {err}.") from None


def merge(base: dict[str, Any], extra: dict[str, dict]) -> dict[str, dict]:
    """Overlay `extra` on `base` by section; a top-level key that is not a table is an error."""
    bad = [
        f"{name} = {value!r}: expected a [{name}] table of settings."
        for name, value in base.items()
        if not isinstance(value, dict)
    ]
    if bad:
        raise ConfigError(bad)
    out = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def closest(name: str, known: typing.Iterable[str]) -> str | None:
    """The known name `name` is most likely a misspelling of (difflib's ratio >= 0.6), or None."""
    matches = difflib.get_close_matches(name, list(known), n=1)
    return matches[0] if matches else None


def unknown_field(section: str, key: str, known: typing.Iterable[str]) -> str:
    """'section.key is not a setting; did you mean section.<closest>?' or, with no name close
    to it, the known fields of `section`."""
    known = sorted(known)
    what = f"{section}.{key} is not a setting"
    if guess := closest(key, known):
        return f"{what}; did you mean {section}.{guess}?"
    return f"{what}; known {section} fields: {', '.join(known)}."


def build(cls: type[T], values: dict[str, Any], section: str, problems: list[str]) -> T | None:
    """Build dataclass `cls` from `values`, appending unknown-field and type problems."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "notes"}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            problems.append(unknown_field(section, key, known))
            continue
        coerced = _coerce(value, hints[key])
        if coerced is _BAD:
            text = f"{section}.{key} = {value!r}: expected {_type_name(hints[key])}"
            if choices := FIELD_CHOICES.get(f"{section}.{key}"):
                text += f"; choose one of {', '.join(map(repr, choices))}"
            problems.append(text + ".")
            continue
        kwargs[key] = coerced
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        problems.append(f"[{section}]: {err}")
        return None


_BAD = object()


def _coerce(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(hint):
            if arg is type(None) and value is None:
                return None
            out = _coerce(value, arg)
            if out is not _BAD:
                return out
        return _BAD
    if hint is bool:
        return value if isinstance(value, bool) else _BAD
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok and math.isfinite(value) else _BAD
    if hint is str:
        return value if isinstance(value, str) else _BAD
    if origin is list:
        return list(value) if isinstance(value, list) else _BAD
    if origin is dict:
        return dict(value) if isinstance(value, dict) else _BAD
    return value


def _type_name(hint: Any) -> str:
    names = {
        int: "a whole number",
        float: "a finite number",
        bool: "true or false",
        str: "a string",
    }
    return names.get(hint, str(hint))


def expand_model(values: dict[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """A [model] table with its preset expanded: the one preset expansion (TOML recipes,
    overrides and `fivefold plan` flags all come through here).

    Fields given override the preset's; derived fields follow what changed: `head_dim` when
    `hidden` or `heads` change, and `kv_heads` when `heads` change on a multi-head preset
    (kv_heads == heads stays so). Without a preset, `ffn` defaults from `hidden`
    (`default_ffn`). None (with a problem appended) for an unknown preset.
    """
    values = dict(values)
    preset = values.pop("preset", None)
    hf_config = values.pop("hf_config", None)
    if hf_config is not None:
        return _expand_hf_config(hf_config, preset, values, problems)
    if preset is None:
        if "ffn" not in values and isinstance(values.get("hidden"), int):
            mlp = values.get("mlp", "swiglu")
            values["ffn"] = default_ffn(values["hidden"], mlp if mlp in MLP_KINDS else "swiglu")
        return values
    if preset not in MODEL_PRESETS:
        problems.append(_unknown_preset("model", preset, MODEL_PRESETS))
        return None
    base = MODEL_PRESETS[preset].to_dict()
    if "heads" in values or "hidden" in values:
        base.pop("head_dim")
    if "heads" in values and "kv_heads" not in values and base["kv_heads"] == base["heads"]:
        base.pop("kv_heads")
    return {**base, **values}


def _expand_hf_config(
    path: Any, preset: Any, values: dict[str, Any], problems: list[str]
) -> dict[str, Any] | None:
    """[model] hf_config = "config.json": the model a Hugging Face config describes
    (`fivefold.specs.hf_config`), the other fields given overriding it (e.g. seq_len). The
    explorer's API passes the file's contents (a JSON object) instead of its path."""
    if preset is not None:
        problems.append(
            f"model.hf_config and model.preset = {preset!r} both name a model; keep one."
        )
        return None
    if not isinstance(path, str | dict):
        problems.append(f"model.hf_config = {path!r}: give the path of a config.json.")
        return None
    try:
        config = path if isinstance(path, dict) else read_hf_config(path)
        where = "the pasted config.json" if isinstance(path, dict) else path
        base = spec_from_hf_config(config, where).to_dict()
    except ConfigError as err:
        problems.extend(err.problems)
        return None
    if "heads" in values or "hidden" in values:
        base.pop("head_dim")
    return {**base, **values}


def _unknown_preset(section: str, preset: Any, presets: typing.Iterable[str]) -> str:
    text = f"{section}.preset = {preset!r} is unknown"
    if isinstance(preset, str) and (guess := closest(preset, presets)):
        return f"{text}; did you mean {guess!r}?"
    return f"{text}; choose one of {', '.join(presets)}."


def _model_from(values: dict[str, Any], problems: list[str]) -> ModelSpec | None:
    expanded = expand_model(values, problems)
    return None if expanded is None else build(ModelSpec, expanded, "model", problems)


def _cluster_from(
    values: dict[str, Any], problems: list[str], default_world: int | None = None
) -> ClusterSpec | None:
    values = dict(values)
    preset = values.pop("preset", None)
    gpus = values.pop("gpus", None)
    if values.get("profile") and preset is None:  # a measured machine: one node of local ranks
        try:
            base = profile_cluster(values["profile"], gpus or default_world).to_dict()
        except ConfigError as err:
            problems.extend(err.problems)
            return None
        values = {**base, **values}
    elif preset is not None:
        if preset not in CLUSTER_PRESETS:
            problems.append(_unknown_preset("cluster", preset, CLUSTER_PRESETS))
            return None
        base = cluster_preset(preset, gpus or 8).to_dict()
        base.update(values)
        values = base
    elif gpus is not None:  # whole nodes of up to 8 GPUs unless gpus_per_node says otherwise
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            problems.append(f"cluster.gpus = {gpus!r}: must be a whole number >= 1.")
            return None
        per_node = values.get("gpus_per_node", 8)
        if isinstance(per_node, int) and per_node > 0:
            try:
                nodes, values["gpus_per_node"] = node_split(
                    gpus, per_node, "cluster.gpus", per_node_field="cluster.gpus_per_node"
                )
            except ConfigError as err:
                problems.extend(err.problems)
                return None
            values.setdefault("nodes", nodes)
    return build(ClusterSpec, values, "cluster", problems)


def model_from_dict(values: dict[str, Any]) -> ModelSpec:
    """A validated `ModelSpec` from a [model] table (preset + overrides), without a plan.

    Raises one ConfigError listing every problem (used where no layout exists yet, e.g. a search).
    """
    problems: list[str] = []
    model = _model_from(values, problems)
    problems += model.problems() if model is not None else []
    if problems:
        raise ConfigError(problems)
    return model  # type: ignore[return-value]


def cluster_from_dict(values: dict[str, Any], default_world: int | None = None) -> ClusterSpec:
    """A validated `ClusterSpec` from a [cluster] table (preset, gpus, overrides), no plan;
    `default_world`: the local ranks a device profile's one node holds when `gpus` is not set."""
    problems: list[str] = []
    cluster = _cluster_from(values, problems, default_world)
    problems += cluster.problems() if cluster is not None else []
    if problems:
        raise ConfigError(problems)
    return cluster  # type: ignore[return-value]


def plan_from_dict(values: dict[str, Any]) -> ParallelPlan:
    """A `ParallelPlan` from a [plan] table checked on its own (no model, no cluster): what a
    search starts from, e.g. for the batch size and precision the recipe asks for."""
    problems: list[str] = []
    plan = build(ParallelPlan, values, "plan", problems)
    problems += plan.problems() if plan is not None else []
    if problems:
        raise ConfigError(problems)
    return plan  # type: ignore[return-value]


def section_problem(name: str) -> str:
    """An unknown section `name` (from a recipe file or an override such as name.x=...)."""
    what = f"[{name}] is not a recipe section (from the file or an override such as {name}.x=...)"
    if guess := closest(name, SECTIONS):
        return f"{what}; did you mean [{guess}]?"
    return f"{what}; known sections: {', '.join(SECTIONS)}."


def recipe_from_dict(data: dict[str, dict[str, Any]], default_world: int | None = None) -> Recipe:
    """Build and validate a recipe; raises one ConfigError listing every problem."""
    problems: list[str] = []
    for name, section in data.items():
        if name not in SECTIONS:
            problems.append(section_problem(name))
        elif not isinstance(section, dict):
            problems.append(f"{name} = {section!r}: expected a [{name}] table of settings.")
    data = {k: v for k, v in data.items() if k in SECTIONS and isinstance(v, dict)}  # go on
    model = _model_from(data.get("model", {}), problems)
    cluster_values = data.get("cluster", {})
    if not cluster_values:
        cluster_values = {"name": "local-cpu", "gpu": "cpu", "gpus": default_world or 1}
    cluster = _cluster_from(cluster_values, problems, default_world)
    plan = build(ParallelPlan, data.get("plan", {}), "plan", problems)
    model_ok = model is not None and not model.problems()
    cluster_ok = cluster is not None and not cluster.problems()
    problems += model.problems() if model is not None else []
    problems += cluster.problems() if cluster is not None else []
    if plan is not None:
        problems += plan.problems(model if model_ok else None, cluster if cluster_ok else None)
    if problems:
        raise ConfigError(problems)
    rest = {k: v for k, v in data.items() if k not in _CORE_SECTIONS}
    return Recipe(model, cluster, plan, rest)  # type: ignore[arg-type]


def load_recipe(
    path: str | Path | None, overrides: list[str] | None = None, default_world: int | None = None
) -> Recipe:
    """Read a TOML recipe (or start empty), apply `section.field=value` overrides, validate."""
    data = read_toml(path) if path else {}
    data = merge(data, parse_overrides(overrides or []))
    return recipe_from_dict(data, default_world)


def dump_recipe(recipe: Recipe, header: str = "") -> str:
    """The recipe as TOML text that `load_recipe` reads back to an equal recipe."""
    lines = [f"# {line}" for line in header.splitlines()]
    sections = {
        "model": recipe.model.to_dict(),
        "cluster": recipe.cluster.to_dict(),
        "plan": recipe.plan.to_dict(),
        **recipe.sections,
    }
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
