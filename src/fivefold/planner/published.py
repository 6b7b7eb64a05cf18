"""The published runs as fivefold specs, and the planner's error against each of them.

`planner/data/published_runs.json` holds the rows of ../shared/calibration/published_runs.md
that the planner can express, each with its source, the configuration as spec fields, the
planner options that describe the software (attention kernel, communication overlap), the
measured figure, and the stated assumptions where the source is silent. This module turns a row
into (model, cluster, plan, options), converts the measured figure into a step time with the
row's FLOP convention, and compares it with `estimate()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.planner.calibration import EfficiencyModel, published_runs
from fivefold.planner.options import PlannerOptions
from fivefold.planner.profiles import row_options
from fivefold.spec.cluster import ClusterSpec, cluster_preset
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.presets import model_preset


@dataclass(frozen=True)
class RunSetup:
    row: int
    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    options: PlannerOptions
    measured_step_s: float


@dataclass(frozen=True)
class RunError:
    """Predicted against measured step time for one published row; error = pred/meas - 1."""

    row: int
    measured_step_s: float
    predicted_step_s: float
    measured_text: str
    predicted_mfu: float

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0


def _model(values: dict) -> ModelSpec:
    values = dict(values)
    preset = values.pop("preset", None)
    if preset:
        return model_preset(preset).with_(**values)
    return ModelSpec(**values)


def measured_step_s(row: dict, model: ModelSpec, plan: ParallelPlan, gpus: int) -> float:
    """The row's measurement as seconds per optimizer step (see the conventions in the JSON)."""
    measured = row["measured"]
    batch = plan.global_batch
    s, h, layers, vocab = model.seq_len, model.hidden, model.layers, model.vocab
    if measured["convention"] == "megatron-sc21-hardware":
        flops = 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
        return flops / (measured["value"] * 1e12 * gpus)
    if measured["convention"] == "megatron-mcore-model":
        flops = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
        return flops / (measured["value"] * 1e12 * gpus)
    if measured["convention"] == "measured tokens/s":
        return batch * s / gpus / measured["value"]
    raise ValueError(f"unknown FLOP convention {measured['convention']!r} in row {row['id']}")


def run_setup(row: dict) -> RunSetup:
    model = _model(row["model"])
    cluster = cluster_preset(row["cluster"]["preset"], row["cluster"]["gpus"])
    if row["cluster"].get("gpu"):  # the source's GPU differs from the preset's (rows 60-61)
        cluster = cluster.with_(gpu=row["cluster"]["gpu"])
    plan = ParallelPlan(**row["plan"])
    options = row_options(row, cluster.device)  # its profile, if it names one, + its options
    step = measured_step_s(row, model, plan, cluster.world_size)
    return RunSetup(row["id"], model, cluster, plan, options, step)


def run_setups() -> list[RunSetup]:
    return [run_setup(row) for row in published_runs()]


def run_errors(
    efficiency: EfficiencyModel | None = None, pipeline: str = "simulate"
) -> list[RunError]:
    """Predicted vs measured step time for every published row."""
    from fivefold.planner.estimate import estimate

    out = []
    rows = {row["id"]: row for row in published_runs()}
    for setup in run_setups():
        # Runs of other software (Megatron-LM, ...): not held to fivefold's runtime rules.
        est = estimate(
            setup.model,
            setup.cluster,
            setup.plan,
            setup.options,
            efficiency,
            pipeline,
            runtime=False,
        )
        out.append(
            RunError(
                setup.row,
                setup.measured_step_s,
                est.step_time_s,
                rows[setup.row]["measured"]["text"],
                est.mfu,
            )
        )
    return out
