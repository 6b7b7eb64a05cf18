"""Efficiency profiles: what a training framework achieves, as named data, and the options in force.

A profile (`planner/data/profiles.json`) is the set of `PlannerOptions` a framework implies: the
attention kernel, dropout, whether TP and DP communication overlap compute, fused element-wise
kernels, the selective-recompute policy and how data-parallel collectives are issued. Four are
shipped: `megatron-2022` (SC21 PTD-P era, no FlashAttention), `nemo-2024` (Megatron-Core r0.8
with TP communication overlap), `torchtitan` (FSDP2, eager, op-level selective recompute) and
`fivefold` (this runtime as `fivefold train` runs a recipe: `PlannerOptions.for_device`, eager
or compiled, on the device). The default is `fivefold` (`DEFAULT_PROFILE`), the options every
estimate takes when given none. The framework profiles plan other software: fivefold's runtime
rules do not bind them (`PlannerOptions.fivefold_runtime`), and the output says so
(`PlannerSettings.software`).

`planner_settings` resolves what is in force for one command, in this order (a later source
replaces an earlier one field by field, and each replacement is stated in `notes`): the profile
(the flag `--profile`, else the recipe's `[planner] profile`, else the default), the recipe's
`[planner]` fields, the command-line option flags. The `[planner]` section may also set
`headroom` (the search's share of HBM left free) and the token-budget fields
(`fivefold.planner.budget.token_budget.BUDGET_KEYS`: tokens, gpu_hour_price, ...), read there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.budget.token_budget import BUDGET_KEYS, MIXTURE_KEY
from fivefold.planner.options import PlannerOptions
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.recipe import build, unknown_field

PROFILES_FILE = Path(__file__).parent / "data" / "profiles.json"
OPTION_FIELDS = tuple(f.name for f in fields(PlannerOptions))
# what a [planner] table may set; the token-budget fields are read by `planner.budget`
SECTION_KEYS = ("profile", "headroom", *OPTION_FIELDS, *BUDGET_KEYS, MIXTURE_KEY)


@dataclass(frozen=True)
class Profile:
    """One framework's options; `options` None means fivefold's own (`for_device`)."""

    name: str
    framework: str
    summary: str
    source: str
    options: dict[str, Any] | None

    def planner_options(self, device: GPUSpec, compile: bool = False) -> PlannerOptions:
        """The options on `device`; `compile` (a recipe's `train.compile`) only changes
        fivefold's own runtime, which compiles its blocks then."""
        if self.options is None:
            return PlannerOptions.for_device(device, compile)
        return PlannerOptions(**self.options)


DEFAULT_PROFILE = "fivefold"


@lru_cache(maxsize=1)
def _load() -> dict[str, Profile]:
    data = json.loads(PROFILES_FILE.read_text())
    return {p["name"]: Profile(**p) for p in data["profiles"]}


def profiles() -> dict[str, Profile]:
    """Every shipped profile by name, in the file's order."""
    return dict(_load())


def profile(name: str, where: str = "--profile") -> Profile:
    """The profile called `name`; a ConfigError naming `where` and the choices otherwise."""
    known = profiles()
    if not isinstance(name, str) or name not in known:
        raise ConfigError(
            f"{where} = {name!r} is not an efficiency profile; choose one of {', '.join(known)}."
        )
    return known[name]


@dataclass(frozen=True)
class PlannerSettings:
    """The options in force for one command, the profile they start from, and what replaced it."""

    profile: str
    options: PlannerOptions
    headroom: float | None = None  # from [planner] headroom, when the recipe sets it
    # What replaced the profile's values, e.g. "attention_kernel = classic (--attention-kernel,
    # replacing torchtitan's flash)"; and those fields with their values.
    notes: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "options": asdict(self.options),
            "overrides": dict(self.overrides),
            "notes": list(self.notes),
        }

    def section(self, headroom: float | None = None) -> dict[str, Any]:
        """The recipe's [planner] table that gives these settings back (with `headroom`, the
        one in force, or else the recipe's own, when either is known)."""
        headroom = self.headroom if headroom is None else headroom
        kept = {} if headroom is None else {"headroom": headroom}
        return {"profile": self.profile, **kept, **self.overrides}

    def describe(self) -> str:
        """One sentence for the explanation: the profile, what was changed on top of it, and
        which software it plans (`software`)."""
        summary = profile(self.profile).summary
        text = f"Efficiency profile {self.profile}: {summary}"
        if self.notes:
            text += "; given on top of it: " + "; ".join(self.notes)
        return f"{text}. {self.software()}"

    def software(self) -> str:
        """What these options plan: fivefold's own runtime (bound by its rules), or other
        software, which `fivefold train` does not run."""
        if self.options.fivefold_runtime:
            how = "compiled blocks" if self.options.compile else "eager"
            return (
                f"It plans fivefold's own runtime ({how}), as `fivefold train` runs the recipe, "
                "with the layouts that runtime runs."
            )
        framework = profile(self.profile).framework
        if self.profile == DEFAULT_PROFILE:
            framework = "fused-kernel software (runtime = fused)"
        return (
            f"It plans other software ({framework}), not fivefold's runtime: layouts fivefold "
            "refuses are allowed, and `fivefold train` runs its own runtime, whose memory and "
            "time differ (`fivefold plan check` counts them)."
        )


def planner_settings(
    device: GPUSpec,
    section: dict[str, Any] | None = None,
    flags: dict[str, Any] | None = None,
    profile_flag: str | None = None,
    flag_names: dict[str, str] | None = None,
    compile: bool = False,
) -> PlannerSettings:
    """Resolve profile, recipe `[planner]` fields and flags (module docstring), validated.

    `section` is the raw `[planner]` table; `flags` maps option fields to values already parsed
    (None values are ignored); `flag_names` maps a field to the flag spelling used in notes
    (default `--field-name`); `compile` is the recipe's `train.compile` (fivefold's runtime
    then compiles its blocks). Raises one ConfigError listing every problem, each naming the
    field (planner.x for the recipe, the flag for the command line).
    """
    section = dict(section or {})
    problems: list[str] = []
    for key in [k for k in section if k not in SECTION_KEYS]:
        problems.append(unknown_field("planner", key, SECTION_KEYS))
        section.pop(key)
    headroom = _headroom(section.pop("headroom", None), problems)
    for key in (*BUDGET_KEYS, MIXTURE_KEY):
        section.pop(key, None)
    recipe_profile = section.pop("profile", None)
    if profile_flag is not None:
        chosen, where = profile_flag, "--profile"
    elif recipe_profile is not None:
        chosen, where = recipe_profile, "planner.profile"
    else:
        chosen, where = DEFAULT_PROFILE, "the default profile"
    try:
        base = profile(chosen, where).planner_options(device, compile)
    except ConfigError as err:
        problems += err.problems
        base = PlannerOptions.for_device(device, compile)
    typed = build(PlannerOptions, section, "planner", problems)
    recipe_values = {k: getattr(typed, k) for k in section} if typed is not None else {}
    given = [("planner." + k, k, v) for k, v in recipe_values.items()]
    names = flag_names or {}
    given += [
        (names.get(k, "--" + k.replace("_", "-")), k, v)
        for k, v in (flags or {}).items()
        if v is not None
    ]
    options, notes = base, []
    for where_given, key, value in given:
        before = getattr(options, key)
        options = replace(options, **{key: value})
        if value != before:
            origin = f"{chosen}'s" if getattr(base, key) == before else "the recipe's"
            replaced = f"replacing {origin} {_show(key, before)}"
            notes.append(f"{key} = {_show(key, value)} ({where_given}, {replaced})")
    if not problems:
        options = _compiled(chosen, device, base, options)
        problems += options.problems()
    if problems:
        raise ConfigError(problems)
    overrides = {
        k: getattr(options, k) for k in OPTION_FIELDS if getattr(options, k) != getattr(base, k)
    }
    return PlannerSettings(chosen, options, headroom, tuple(notes), overrides)


def _compiled(
    chosen: str, device: GPUSpec, base: PlannerOptions, options: PlannerOptions
) -> PlannerOptions:
    """fivefold's runtime with `compile` changed (`--compile`, `[planner] compile`): its
    compiled blocks' options (element-wise work fused), as `train.compile` gives them, with
    every other field given kept."""
    if options.compile == base.compile or profile(chosen).options is not None:
        return options
    given = {
        k: getattr(options, k) for k in OPTION_FIELDS if getattr(options, k) != getattr(base, k)
    }
    given.pop("compile")
    return replace(profile(chosen).planner_options(device, options.compile), **given)


def _headroom(value: Any, problems: list[str]) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0 <= value < 1:  # NaN fails both comparisons
        problems.append(f"planner.headroom = {value!r}: must be a fraction in [0, 1), e.g. 0.1.")
        return None
    return float(value)


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if key.endswith("_bytes"):
        return f"{value / 2**20:.4g} MiB"
    return str(value)


def row_options(row: dict[str, Any], device: GPUSpec) -> PlannerOptions:
    """A published run's options: its `profile` (if it names one) with its `options` on top."""
    base = profile(row["profile"], f"row {row['id']} profile") if "profile" in row else None
    options = base.planner_options(device) if base else PlannerOptions()
    return replace(options, **row.get("options", {}))
