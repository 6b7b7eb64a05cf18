"""The published runs as fivefold specs, and the planner's error against each of them.

`planner/data/published_runs.json` holds the rows of ../shared/calibration/published_runs.md
that the planner can express, each with its source (`source`, and `source_key` naming the
publication it is held out with), the configuration as spec fields, the planner options that
describe the software (attention kernel, communication overlap), the measured figure with its
FLOP convention, an optional per-GPU memory figure, and the assumptions where the source is
silent. Rows it cannot express are listed under `skipped`, each with the reason. This module
turns a row into (model, cluster, plan, options), converts the measured figure into a step time
with the row's convention, and compares it (and the memory figure) with `estimate()`.

A row the planner misses beyond the targets carries `unknowns`: what its source does not state
that decides the figure, each entry a `text` and, where the unknown can be expressed, a
`what_if`: a patch of the row (`model`, `cluster`, `plan`, `options`, `memory`, ... fields, and
`efficiency` parameters) whose error `what_if_error` computes with the estimator, so the move an
unknown could make is never quoted by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.planner.estimate import estimate
from fivefold.planner.frameworks import profile, row_options
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.efficiency import EfficiencyModel, published_runs
from fivefold.specs.cluster import ClusterSpec, cluster_preset
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset
from fivefold.units import GiB

GB = 1e9
MEMORY_UNITS = {"GB": GB, "GiB": GiB}


@dataclass(frozen=True)
class RunSetup:
    row: str
    source: str  # the row's `source_key`: rows of one publication are held out together
    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    options: PlannerOptions
    measured_step_s: float
    measured_memory_bytes: float | None  # per-GPU peak the source reports, if any


@dataclass(frozen=True)
class RunError:
    """Predicted against measured step time for one published row; error = pred/meas - 1."""

    row: str
    source: str
    measured_step_s: float
    predicted_step_s: float
    measured_text: str
    predicted_mfu: float
    measured_memory_bytes: float | None = None
    predicted_memory_bytes: float | None = None

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0

    @property
    def memory_error(self) -> float | None:
        if self.measured_memory_bytes is None or self.predicted_memory_bytes is None:
            return None
        return self.predicted_memory_bytes / self.measured_memory_bytes - 1.0


def _model(values: dict) -> ModelSpec:
    values = dict(values)
    preset = values.pop("preset", None)
    if preset:
        return model_preset(preset).with_(**values)
    return ModelSpec(**values)


def _cluster(values: dict) -> ClusterSpec:
    """The preset at the row's GPU count, with the row's overrides (a different GPU, a slower
    inter-node fabric) applied on top."""
    values = dict(values)
    cluster = cluster_preset(values.pop("preset"), values.pop("gpus"))
    return cluster.with_(**values) if values else cluster


def dgxc_model_flops_per_sequence(model: ModelSpec) -> float:
    """NVIDIA dgxc's model FLOPs of one sequence (GQA, SwiGLU, full non-causal attention):
    s (12 L h^2 (1 + kv/a + s/h) + 18 L ffn h + 6 V h)."""
    s, h, layers = model.seq_len, model.hidden, model.layers
    attn = 12 * layers * h**2 * (1 + model.kv_heads / model.heads + s / h)
    return s * (attn + 18 * layers * model.ffn * h + 6 * model.vocab * h)


def nanotron_model_flops_per_token(model: ModelSpec) -> float:
    """nanotron's model FLOPs per token: 6 x the matmul parameters (projections, MLP, LM head)
    plus 12 L s (heads x head_dim) for non-causal attention scores."""
    h, layers, q = model.hidden, model.layers, model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    matmul_params = layers * (2 * h * q + 2 * h * kv + 3 * h * model.ffn) + model.vocab * h
    return 6 * matmul_params + 12 * layers * model.seq_len * q


def measured_step_s(row: dict, model: ModelSpec, plan: ParallelPlan, gpus: int) -> float:
    """The row's measurement as seconds per optimizer step (see the conventions in the JSON)."""
    measured = row["measured"]
    convention, value = measured["convention"], measured["value"]
    batch = plan.global_batch
    s, h, layers, vocab = model.seq_len, model.hidden, model.layers, model.vocab
    if convention == "measured step time":
        return value
    if convention == "measured tokens/s":
        return batch * s / gpus / value
    if convention == "megatron-sc21-hardware":
        flops = 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
    elif convention == "megatron-mcore-model":
        flops = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    elif convention == "dgxc-model":
        flops = batch * dgxc_model_flops_per_sequence(model)
    elif convention == "nanotron-mfu":
        flops = batch * s * nanotron_model_flops_per_token(model)
        return flops / (value / 100 * 989.4e12 * gpus)  # MFU in % of the H100 bf16 dense peak
    else:
        raise ValueError(f"unknown FLOP convention {convention!r} in row {row['id']}")
    return flops / (value * 1e12 * gpus)


def measured_memory_bytes(row: dict) -> float | None:
    memory = row.get("memory")
    if not memory:
        return None
    value = memory.get("value_gib", memory.get("value_gb"))
    return value * MEMORY_UNITS[memory["unit"]]


# What a `what_if` may patch: the row's own sections, and the efficiency model's parameters.
WHAT_IF_SECTIONS = ("model", "cluster", "plan", "options", "measured", "memory", "efficiency")


def check_unknowns(row: dict) -> None:
    """Raise ValueError unless the row's `unknowns` (if any) are a non-empty list of entries,
    each with a non-empty `text` and an optional `what_if` that patches only known sections,
    each with a table of fields. (A patched layout the planner rejects raises ConfigError when
    it is priced, by `what_if_error`.)"""
    if "unknowns" not in row:
        return
    entries = row["unknowns"]
    where = f"row {row['id']} unknowns"
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a non-empty list of {{text, what_if}} entries")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not str(entry.get("text", "")).strip():
            raise ValueError(f"{where}[{i}]: every entry needs a non-empty 'text'")
        extra = set(entry) - {"text", "what_if"}
        if extra:
            raise ValueError(f"{where}[{i}]: unknown keys {sorted(extra)}; use text, what_if")
        what_if = entry.get("what_if")
        if what_if is None:
            continue
        bad = set(what_if) - set(WHAT_IF_SECTIONS) if isinstance(what_if, dict) else {"?"}
        if not what_if or bad:
            raise ValueError(
                f"{where}[{i}].what_if patches {sorted(bad) or 'nothing'}; "
                f"patch some of {', '.join(WHAT_IF_SECTIONS)}"
            )
        for section, values in what_if.items():
            if not isinstance(values, dict) or not values:
                raise ValueError(f"{where}[{i}].what_if.{section}: expected a table of fields")
        patched_efficiency(EfficiencyModel(), what_if)


def patched_row(row: dict, what_if: dict) -> dict:
    """`row` with each section of `what_if` (but `efficiency`) merged over the row's section."""
    out = {k: v for k, v in row.items() if k != "unknowns"}
    for section, values in what_if.items():
        if section != "efficiency":
            out[section] = {**row.get(section, {}), **values}
    return out


def patched_efficiency(efficiency: EfficiencyModel, what_if: dict) -> EfficiencyModel:
    """`efficiency` with the what-if's `efficiency` parameters (`gemm_peak_fraction` merged per
    architecture); ValueError on a name the model does not have."""
    values = dict(what_if.get("efficiency", {}))
    unknown = set(values) - set(EfficiencyModel.__dataclass_fields__)
    if unknown:
        raise ValueError(f"what_if.efficiency: no parameters {sorted(unknown)}")
    if "gemm_peak_fraction" in values:
        table = {**dict(efficiency.gemm_peak_fraction), **values["gemm_peak_fraction"]}
        values["gemm_peak_fraction"] = tuple(sorted(table.items()))
    return replace(efficiency, **values)


def what_if_label(what_if: dict) -> str:
    """The patch in words, e.g. "plan.micro_batch = 2, options.tp_comm_overlap = false"."""
    parts = []
    for section, values in what_if.items():
        for key, value in values.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            elif isinstance(value, bool):
                value = str(value).lower()
            parts.append(f"{section}.{key} = {value}")
    return ", ".join(parts)


def run_setup(row: dict) -> RunSetup:
    check_unknowns(row)
    model = _model(row["model"])
    cluster = _cluster(row["cluster"])
    plan = ParallelPlan(**row["plan"])
    options = row_options(row, cluster.device)  # its profile, if it names one, + its options
    step = measured_step_s(row, model, plan, cluster.world_size)
    memory = measured_memory_bytes(row)
    return RunSetup(row["id"], row["source_key"], model, cluster, plan, options, step, memory)


def run_setups() -> list[RunSetup]:
    return [run_setup(row) for row in published_runs()]


def run_errors(
    efficiency: EfficiencyModel | None = None,
    pipeline: str = "simulate",
    rows: set[str] | None = None,
) -> list[RunError]:
    """Predicted vs measured step time (and memory, where published) for every published row,
    or for the rows whose ids are in `rows`."""
    texts = {row["id"]: row["measured"]["text"] for row in published_runs()}
    return [
        _error(setup, texts[setup.row], efficiency, pipeline)
        for setup in _cached_setups()
        if rows is None or setup.row in rows
    ]


def profile_errors(
    name: str, efficiency_of: dict[str, EfficiencyModel], rows: set[str]
) -> list[RunError]:
    """The rows whose ids are in `rows` planned as `--profile name` plans them (the profile's
    options, none of the row's own), each with the efficiency model of its source
    (`efficiency_of[source]`: the leave-one-source-out fit that never saw the row)."""
    texts = {row["id"]: row["measured"]["text"] for row in published_runs()}
    out = []
    for setup in _cached_setups():
        if setup.row in rows:
            options = profile(name).planner_options(setup.cluster.device)
            patched = replace(setup, options=options)
            out.append(_error(patched, texts[setup.row], efficiency_of[setup.source]))
    return out


def what_if_error(row: dict, what_if: dict, efficiency: EfficiencyModel) -> RunError:
    """The row's error with `what_if` applied to the row and to `efficiency`."""
    setup = run_setup(patched_row(row, what_if))
    return _error(setup, row["measured"]["text"], patched_efficiency(efficiency, what_if))


def _error(
    setup: RunSetup, text: str, efficiency: EfficiencyModel | None, pipeline: str = "simulate"
) -> RunError:
    # Runs of other software (Megatron-LM, ...): not held to fivefold's runtime rules.
    est = estimate(
        setup.model, setup.cluster, setup.plan, setup.options, efficiency, pipeline, runtime=False
    )
    return RunError(
        setup.row,
        setup.source,
        setup.measured_step_s,
        est.step_time_s,
        text,
        est.mfu,
        setup.measured_memory_bytes,
        est.peak_memory_bytes if setup.measured_memory_bytes else None,
    )


_SETUPS: list[RunSetup] = []


def _cached_setups() -> list[RunSetup]:
    if not _SETUPS:
        _SETUPS.extend(run_setups())
    return _SETUPS
