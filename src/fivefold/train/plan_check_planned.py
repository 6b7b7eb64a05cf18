"""What the planner says of the layout `fivefold plan check` measures: the estimate `fivefold
plan` makes of a recipe's own layout (its [planner] table, its `train.compile`), per pipeline
stage, and the GPU memory the search allows. No torch: `fivefold plan` imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.estimate import estimate
from fivefold.planner.frameworks import PlannerSettings, planner_settings
from fivefold.planner.request import resolve_headroom
from fivefold.train.config import recipe_compile


@dataclass(frozen=True)
class Planned:
    """What `fivefold plan` prints for the recipe's layout (its [planner] table, its
    `train.compile`): per pipeline stage the whole peak in bytes (CUDA context and
    fragmentation included; None when the planner has no estimate, `why_not`), and the GPU
    memory the search allows (HBM less the headroom; 0 on a CPU cluster)."""

    settings: PlannerSettings
    stage_bytes: list[float] | None
    step_s: float | None
    usable_bytes: float
    headroom: float
    hbm_bytes: float
    why_not: str = ""

    def whole_bytes(self, counted: float) -> float:
        """`counted` tensor bytes with the CUDA context and the allocator's fragmentation as
        the planner adds them (`memory.stage_memory`): (tensors + context) x (1 + f)."""
        opts = self.settings.options
        return (counted + opts.cuda_context_bytes) * (1 + opts.fragmentation_fraction)

    def fits(self, counted: float) -> bool | None:
        """Whether `counted` bytes fit the usable memory with context and fragmentation (None
        without a GPU to fit)."""
        return self.whole_bytes(counted) <= self.usable_bytes if self.usable_bytes else None


def planned_for(recipe: Any) -> Planned:
    """The estimate `fivefold plan` (and `plan estimate RECIPE`) makes of the recipe's own
    layout, with the profile and options its [planner] table and `train.compile` give."""
    compiled = recipe_compile(recipe.sections)  # train.compile, checked
    cluster = recipe.cluster
    settings = planner_settings(cluster.device, recipe.section("planner"), compile=compiled)
    headroom = resolve_headroom(None, settings)
    hbm = float(cluster.device.hbm_bytes or 0) if cluster.gpu != "cpu" else 0.0
    usable = hbm * (1 - headroom)
    try:
        est = estimate(recipe.model, cluster, recipe.plan, settings.options)
    except ConfigError as err:
        why = str(err).strip().splitlines()[0]
        return Planned(settings, None, None, usable, headroom, hbm, why)
    totals = [float(stage.total) for stage in est.memory]
    return Planned(settings, totals, est.step_time_s, usable, headroom, hbm)
