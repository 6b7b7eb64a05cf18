"""The one front door for a planning request: every default applied once, in one place.

`fivefold plan` reads its flags and recipe, the explorer its JSON body; each builds a
`PlanRequest` (None where the request is silent) and calls `resolve_request`, which settles the
headroom, the batch target, the number of alternatives, the precisions, the risk and the planner
options. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fivefold.planner.budget.uncertainty import DEFAULT_RISK
from fivefold.planner.frameworks import PlannerSettings
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.outcomes import BATCH_TOLERANCE
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.model import ModelSpec

DEFAULT_HEADROOM = 0.10  # share of HBM left free
DEFAULT_TOP = 5  # alternatives shown beside the best layout
DEFAULT_PRECISIONS = ("bf16-mixed",)  # changing numerics is a modelling decision, not a layout one
MAX_BATCH_SEQUENCES = 1 << 24  # a global batch beyond this is a typo, not a plan


@dataclass(frozen=True)
class PlanRequest:
    """A planning request as its front end read it; None where the request is silent."""

    model: ModelSpec
    cluster: ClusterSpec
    settings: PlannerSettings  # the profile and options in force (`profiles.planner_settings`)
    pins: dict[str, Any] = field(default_factory=dict)  # plan fields the search keeps fixed
    global_batch: int | None = None  # sequences per optimizer step
    global_batch_tokens: int | None = None
    recipe_batch: int | None = None  # a recipe's own global batch: the target when none is given
    headroom: float | None = None
    batch_tolerance: float | None = None
    top: int | None = None
    precisions: tuple[str, ...] | None = None
    risk: str | None = None


@dataclass(frozen=True)
class ResolvedRequest:
    """A request with every default in force: what the search is called with."""

    model: ModelSpec
    cluster: ClusterSpec
    pins: dict[str, Any]
    options: PlannerOptions
    headroom: float
    global_batch: int | None  # the batch target, in sequences or tokens (neither given:
    global_batch_tokens: int | None  # `outcomes.DEFAULT_BATCH_TOKENS`, in `outcomes.batch_target`)
    batch_tolerance: float
    top: int
    precisions: tuple[str, ...]
    risk: str

    def search_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `planner.search.layouts.search` besides model and cluster."""
        return {
            "global_batch_tokens": self.global_batch_tokens,
            "global_batch": self.global_batch,
            "headroom": self.headroom,
            "top": self.top,
            "batch_tolerance": self.batch_tolerance,
            "precisions": self.precisions,
            "fixed": dict(self.pins),
            "options": self.options,
            "risk": self.risk,
        }


def resolve_request(request: PlanRequest) -> ResolvedRequest:
    """`request` with every default applied (module docstring)."""
    given_batch = request.global_batch is not None or request.global_batch_tokens is not None
    return ResolvedRequest(
        model=request.model,
        cluster=request.cluster,
        pins=dict(request.pins),
        options=request.settings.options,
        headroom=resolve_headroom(request.headroom, request.settings),
        global_batch=request.global_batch if given_batch else request.recipe_batch,
        global_batch_tokens=request.global_batch_tokens,
        batch_tolerance=_given(request.batch_tolerance, BATCH_TOLERANCE),
        top=_given(request.top, DEFAULT_TOP),
        precisions=_given(request.precisions, DEFAULT_PRECISIONS),
        risk=_given(request.risk, DEFAULT_RISK),
    )


def resolve_headroom(given: float | None, settings: PlannerSettings) -> float:
    """The headroom asked for, else the [planner] table's, else `DEFAULT_HEADROOM`."""
    if given is not None:
        return given
    return DEFAULT_HEADROOM if settings.headroom is None else settings.headroom


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
