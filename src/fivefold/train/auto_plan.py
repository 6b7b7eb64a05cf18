"""The planner's part in a run: `--plan auto`'s layout search on the local processes, and the
recipe's `[planner]` table checked beside a run (its efficiency profile plays no part in the
run's own predictions, which model fivefold's runtime).

The CLI (`fivefold train`) parses, calls these and prints; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.frameworks import DEFAULT_PROFILE, PlannerSettings, planner_settings
from fivefold.planner.options import PlannerOptions
from fivefold.planner.search.layouts import search
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import default_profile_path
from fivefold.specs.recipe import cluster_from_dict, model_from_dict, plan_from_dict
from fivefold.specs.toml_text import toml_value
from fivefold.train.config import parse_train_section
from fivefold.train.entry import recipe_data, with_default_profile


@dataclass(frozen=True)
class AutoPlan:
    """The layout `--plan auto` chose and the cluster it was planned for."""

    plan: ParallelPlan
    cluster: ClusterSpec

    def overrides(self) -> list[str]:
        """The chosen layout as `plan.field=value` overrides of the recipe."""
        return [f"plan.{key}={toml_value(value)}" for key, value in self.plan.to_dict().items()]

    def describe(self, nproc: int) -> str:
        return (
            f"{self.plan.describe()} (planned for {nproc} x {self.cluster.device.name}, "
            f"{self.cluster.name})"
        )


def auto_plan(recipe_path: str | Path | None, overrides: list[str], nproc: int) -> AutoPlan:
    """The planner's best layout of the recipe's model on the `nproc` local processes.

    The recipe's own degrees are ignored (the search chooses them); its model, cluster, global
    batch (the parsed `train.global_batch`, else its plan's micro_batch x dp x grad_accum),
    optimizer, compile and precision are kept. A GPU run without [cluster] plans for the GPU it
    finds; a CPU run against the calibrated device profile (`fivefold calibrate`).
    """
    data = with_default_profile(recipe_data(recipe_path, overrides), nproc)  # or this GPU's
    model = model_from_dict(data.get("model", {}))
    local = {"name": "local-cpu", "gpu": "cpu", "gpus": nproc}
    cluster = cluster_from_dict(data.get("cluster") or local, default_world=nproc)
    if not cluster.device.hbm_bytes:
        raise ConfigError(
            f"--plan auto on {cluster.gpu!r} needs a measured device: run `fivefold calibrate "
            f"RECIPE --nproc {nproc} --install` first (it writes {default_profile_path()}, "
            'which CPU runs then use), or name a profile as [cluster] profile = "PATH".'
        )
    if cluster.world_size != nproc:
        raise ConfigError(
            f"--plan auto plans for the {nproc} process(es) of --nproc, but the recipe's "
            f"[cluster] has {cluster.world_size} GPUs; set --nproc {cluster.world_size} or "
            "change cluster.gpus."
        )
    plan = plan_from_dict(data.get("plan", {}))
    train = parse_train_section(data)
    headroom = run_planner_settings(data.get("planner"), cluster.device, train.compile).headroom
    # fivefold's runtime as this run will compile its blocks and step its optimizer
    options = PlannerOptions.for_device(cluster.device, train.compile)
    options = replace(options, optimizer=train.optimizer)
    result = search(  # ConfigError when nothing fits, naming what came closest
        model,
        cluster,
        global_batch=train.global_batch or plan.global_batch,
        precisions=(plan.precision,),
        options=options,
        **({} if headroom is None else {"headroom": headroom}),
    )
    return AutoPlan(result.best_plan, cluster)


def run_planner_settings(section: Any, device: GPUSpec, compiled: bool) -> PlannerSettings:
    """The recipe's `[planner]` table, validated (ConfigError naming `planner.x` otherwise), for
    a run compiling its blocks when `compiled`; `--plan auto` uses its `headroom`."""
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"planner = {section!r}: expected a [planner] table of settings.")
    return planner_settings(device, section or {}, compile=compiled)


def foreign_profile_note(settings: PlannerSettings) -> str | None:
    """A note when the `[planner]` table describes other software than fivefold's runtime: a
    run is predicted as what it is (the `fivefold` efficiency profile), so that table plays no
    part in the prediction beside the run."""
    if settings.profile == DEFAULT_PROFILE and not settings.overrides:
        return None
    return (
        f"note: [planner] ({settings.describe()}) is for `fivefold plan`; this run's "
        f"predictions model fivefold's own runtime (profile {DEFAULT_PROFILE!r})."
    )
