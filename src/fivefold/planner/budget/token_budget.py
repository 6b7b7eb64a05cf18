"""The token-budget answer: wall-clock time, GPU-hours, cost, failures and checkpointing.

Details: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.memory.levers import state_recipe
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.mixture import Mixture, SourceDraw, draw_lines, draws, parse_mixture
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.plan import ParallelPlan

HOUR_S = 3600.0
DAY_S = 86400.0
GB = 1e9

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4, table 5): 419
# unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
DEFAULT_FAILURE_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)  # per GPU-hour
FAILURE_RATE_SOURCE = (
    "Llama 3: 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al. 2024, table 5)"
)
# Llama 3's storage (same paper, sec. 3.3.1): Tectonic sustains 2 TB/s for the 16,384-GPU
# (2,048-node) cluster, so each node's share is 2e12 / 2048 bytes/s, about 0.98 GB/s.
DEFAULT_CKPT_BANDWIDTH = 2e12 / (LLAMA3_GPUS // 8)  # bytes/s per node
CKPT_BANDWIDTH_SOURCE = (
    "Llama 3's Tectonic storage, 2 TB/s sustained shared by 2,048 nodes (Dubey et al. 2024, "
    "sec. 3.3.1)"
)
# An assumption, not a measurement: rescheduling, process start and checkpoint load together.
DEFAULT_RESTART_S = 600.0

# Checkpoints a run keeps (train.keep_checkpoints's default): if the newest proves damaged, the
# one before it is still there.
KEEP_CHECKPOINTS = 2

# [planner] fields this module reads (recipe spelling) -> BudgetInputs fields
BUDGET_KEYS = ("tokens", "gpu_hour_price", "failure_rate", "ckpt_bandwidth", "restart_overhead_s")
MIXTURE_KEY = "sources"  # [planner] sources: the data mixture (`fivefold.specs.mixture`)


@dataclass(frozen=True)
class BudgetInputs:
    """What the answer needs besides the layout. `ckpt_bandwidth` is bytes/s per node."""

    tokens: float
    gpu_hour_price: float | None = None  # USD per GPU-hour; None: no cost
    failure_rate: float = DEFAULT_FAILURE_RATE  # interruptions per GPU-hour
    ckpt_bandwidth: float = DEFAULT_CKPT_BANDWIDTH
    restart_overhead_s: float = DEFAULT_RESTART_S
    sources: Mixture = ()  # the data mixture: tokens and epochs per source

    def problems(self, where: str = "planner") -> list[str]:
        out = []
        for name, low in (
            ("tokens", 1.0),
            ("failure_rate", 0.0),
            ("ckpt_bandwidth", 1.0),
            ("restart_overhead_s", 0.0),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= low):
                out.append(f"{where}.{name} = {value!r}: must be a finite number >= {low:g}.")
        price = self.gpu_hour_price
        if price is not None and not (math.isfinite(price) and price >= 0):
            out.append(f"{where}.gpu_hour_price = {price!r}: must be >= 0 (USD per GPU-hour).")
        return out


def budget_values(section: dict[str, Any], flags: dict[str, Any]) -> dict[str, float]:
    """The budget fields a [planner] table and flags give (flags, parsed, None = not given, win
    over the table); ConfigError naming each field that is not a number."""
    values: dict[str, float] = {}
    problems = []
    for key in BUDGET_KEYS:
        raw = section.get(key)
        if raw is None:
            continue
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            problems.append(f"planner.{key} = {raw!r}: must be a number.")
            continue
        values[key] = float(raw)
    if problems:
        raise ConfigError(problems)
    return values | {k: float(v) for k, v in flags.items() if v is not None}


def budget_inputs(section: dict[str, Any], flags: dict[str, Any]) -> BudgetInputs | None:
    """The inputs from a [planner] table and flags (`budget_values`); None when no token count
    is given anywhere; ConfigError naming each bad field."""
    flags = dict(flags)
    mixture = flags.pop(MIXTURE_KEY, None)
    if mixture is None and section.get(MIXTURE_KEY) is not None:
        mixture = parse_mixture(section[MIXTURE_KEY])
    values = budget_values(section, flags) | ({MIXTURE_KEY: mixture} if mixture else {})
    if "tokens" not in values:
        if values:
            raise ConfigError(
                f"{', '.join(sorted(values))} given without a token count: add --tokens (e.g. "
                "500B) or [planner] tokens = 5e11."
            )
        return None
    inputs = BudgetInputs(**values)
    if inputs.problems():
        raise ConfigError(inputs.problems())
    return inputs


def checkpoint_bytes(model: ModelSpec, plan: ParallelPlan) -> float:
    """Bytes of one full checkpoint: every parameter's weights and optimizer state (master copy
    and Adam's m and v) in the plan's precision recipe and optimizer-state format."""
    rec = state_recipe(plan)
    return param_count(model) * (rec.param_bytes + rec.optimizer_bytes)


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: seconds of work between checkpoints, sqrt(2 d M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


@dataclass(frozen=True)
class Budget:
    """The answer for one layout; times in seconds, sizes in bytes."""

    tokens: float
    steps: int
    step_time_s: float
    tokens_per_step: int
    gpus: int
    useful_s: float  # W: steps x step time
    failure_rate: float  # per GPU-hour
    mtbf_s: float
    checkpoint_bytes: float
    save_s: float
    interval_steps: int
    interval_s: float  # tau, whole steps
    restart_overhead_s: float
    wall_s: float  # T
    interruptions: float
    checkpoint_lost_s: float
    restart_lost_s: float
    recompute_lost_s: float
    gpu_hour_price: float | None
    sources: tuple[SourceDraw, ...] = ()  # what the tokens draw of each source of a mixture

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.wall_s / HOUR_S

    @property
    def cost_usd(self) -> float | None:
        return None if self.gpu_hour_price is None else self.gpu_hours * self.gpu_hour_price

    @property
    def storage_bytes(self) -> float:
        """Checkpoint storage the run needs at its peak: KEEP_CHECKPOINTS committed checkpoints
        and the one being written (older ones are pruned only once it is committed)."""
        return (KEEP_CHECKPOINTS + 1) * self.checkpoint_bytes

    @property
    def progresses(self) -> bool:
        return math.isfinite(self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "step_time_s": self.step_time_s,
            "gpus": self.gpus,
            "days": self.wall_s / DAY_S if self.progresses else None,
            "failure_free_days": self.useful_s / DAY_S,
            "gpu_hours": self.gpu_hours if self.progresses else None,
            "gpu_hour_price": self.gpu_hour_price,
            "cost_usd": self.cost_usd if self.progresses else None,
            "failure_rate_per_gpu_hour": self.failure_rate,
            "failure_rate_source": FAILURE_RATE_SOURCE
            if self.failure_rate == DEFAULT_FAILURE_RATE
            else "given",
            "mtbf_hours": self.mtbf_s / HOUR_S,
            "interruptions": self.interruptions if self.progresses else None,
            "checkpoint_gb": self.checkpoint_bytes / GB,
            "checkpoint_save_s": self.save_s,
            "checkpoint_interval_steps": self.interval_steps,
            "checkpoint_interval_s": self.interval_s,
            "checkpoints_kept": KEEP_CHECKPOINTS,
            "checkpoint_storage_gb": self.storage_bytes / GB,
            "restart_overhead_s": self.restart_overhead_s,
            "lost_hours": {
                "checkpoints": self.checkpoint_lost_s / HOUR_S,
                "restarts": self.restart_lost_s / HOUR_S,
                "recompute": self.recompute_lost_s / HOUR_S,
            },
            "goodput": self.goodput,
        } | ({"sources": [d.to_json() for d in self.sources]} if self.sources else {})


def interval_steps(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    step_time_s: float,
    failure_rate: float = DEFAULT_FAILURE_RATE,
    ckpt_bandwidth: float = DEFAULT_CKPT_BANDWIDTH,
) -> tuple[int, float, float]:
    """(steps between checkpoints, save seconds, MTBF seconds) by Young's rule, at least 1."""
    save_s = checkpoint_bytes(model, plan) / (ckpt_bandwidth * cluster.nodes)
    rate_s = failure_rate * cluster.world_size / HOUR_S
    mtbf_s = 1.0 / rate_s if rate_s > 0 else math.inf
    tau = young_interval_s(save_s, mtbf_s)
    steps = max(1, round(tau / step_time_s)) if math.isfinite(tau) else 0
    return steps, save_s, mtbf_s


def budget(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    step_time_s: float,
    inputs: BudgetInputs,
) -> Budget:
    """The budget answer for `plan` at `step_time_s` per step (module docstring for the rules).

    With no failures (rate 0) no checkpoint is needed: interval 0, goodput 1. When failures
    come faster than the run can recover (L (R + tau/2) >= 1) the wall time is infinite."""
    tokens_per_step = plan.global_batch * model.seq_len
    steps = math.ceil(inputs.tokens / tokens_per_step)
    useful = steps * step_time_s
    k, save_s, mtbf_s = interval_steps(
        model, cluster, plan, step_time_s, inputs.failure_rate, inputs.ckpt_bandwidth
    )
    rate_s = 1.0 / mtbf_s
    tau = k * step_time_s
    if k == 0:  # no failures: nothing to checkpoint for
        wall, saving = useful, 0.0
    else:
        saving = useful / tau * save_s
        lost_fraction = rate_s * (inputs.restart_overhead_s + tau / 2)
        wall = (useful + saving) / (1 - lost_fraction) if lost_fraction < 1 else math.inf
    n = rate_s * wall if math.isfinite(wall) else math.inf
    return Budget(
        tokens=inputs.tokens,
        steps=steps,
        step_time_s=step_time_s,
        tokens_per_step=tokens_per_step,
        gpus=cluster.world_size,
        useful_s=useful,
        failure_rate=inputs.failure_rate,
        mtbf_s=mtbf_s,
        checkpoint_bytes=checkpoint_bytes(model, plan),
        save_s=save_s,
        interval_steps=k,
        interval_s=tau,
        restart_overhead_s=inputs.restart_overhead_s,
        wall_s=wall,
        interruptions=n,
        checkpoint_lost_s=saving,
        restart_lost_s=n * inputs.restart_overhead_s,
        recompute_lost_s=n * tau / 2,
        gpu_hour_price=inputs.gpu_hour_price,
        sources=tuple(draws(inputs.tokens, *map(list, zip(*inputs.sources, strict=True))))
        if inputs.sources
        else (),
    )


def _count(tokens: float) -> str:
    """500000000000 -> '500B', 1.5e12 -> '1.5T', 12345 -> '12,345'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if tokens >= scale:
            return f"{tokens / scale:,.4g}{suffix}"
    return f"{tokens:,.0f}"


def budget_lines(b: Budget) -> list[str]:
    """The answer in a few printed lines."""
    if not b.progresses:
        return [
            f"budget: {_count(b.tokens)} tokens in {b.steps:,} steps never finish: at "
            f"{b.failure_rate:.3g} failures per GPU-hour on {b.gpus:,} GPUs (MTBF "
            f"{b.mtbf_s / HOUR_S:.2f} h) a failure comes before the restart and the lost "
            "interval are made up; lower the failure rate or the restart overhead."
        ]
    cost = (
        f"${b.cost_usd:,.0f} at ${b.gpu_hour_price:g}/GPU-hour"
        if b.cost_usd is not None
        else "cost: give --gpu-hour-price (USD per GPU-hour)"
    )
    lines = [
        f"budget: {_count(b.tokens)} tokens = {b.steps:,} steps: {b.wall_s / DAY_S:,.1f} days "
        f"({b.useful_s / DAY_S:,.1f} without failures), {b.gpu_hours:,.0f} GPU-hours, {cost}",
        f"  failures: {b.interruptions:,.1f} expected interruptions (MTBF "
        f"{b.mtbf_s / HOUR_S:,.1f} h at {b.failure_rate:.3g} per GPU-hour"
        + (", Llama 3's rate)" if b.failure_rate == DEFAULT_FAILURE_RATE else ", as given)"),
    ]
    if b.interval_steps:
        lines.append(
            f"  checkpoint: {b.checkpoint_bytes / GB:,.1f} GB, {b.save_s:,.1f} s to save; "
            f"every {b.interval_steps:,} steps ({b.interval_s / 60:,.1f} min, Young's "
            f"sqrt(2 x save x MTBF)); keeping {KEEP_CHECKPOINTS} (and one being written): "
            f"{b.storage_bytes / GB:,.1f} GB of storage"
        )
    lines.append(
        f"  lost: {b.checkpoint_lost_s / HOUR_S:,.1f} h saving, "
        f"{b.restart_lost_s / HOUR_S:,.1f} h restarting, {b.recompute_lost_s / HOUR_S:,.1f} h "
        f"recomputing; goodput {b.goodput:.1%}"
    )
    if b.sources:
        lines += ["  data, per source:", *draw_lines(list(b.sources), "    ")]
    return lines


def checkpoint_suggestion(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    step_time_s: float,
    section: dict[str, Any] | None = None,
    run_steps: int | None = None,
) -> str:
    """The line a run prints when `train.ckpt_every` is unset: Young's interval in steps at the
    [planner] table's failure rate and storage bandwidth (or the catalog defaults); none when
    it is no shorter than the run's `run_steps` (the final checkpoint is all it needs)."""
    values = budget_values(section or {}, {})
    rate = values.get("failure_rate", DEFAULT_FAILURE_RATE)
    bandwidth = values.get("ckpt_bandwidth", DEFAULT_CKPT_BANDWIDTH)
    steps, save_s, mtbf_s = interval_steps(model, cluster, plan, step_time_s, rate, bandwidth)
    if steps == 0:
        return "checkpoint suggestion: none needed at a failure rate of 0 (planner.failure_rate)"
    why = (
        f"Young's interval for a {_duration(save_s)} save and an MTBF of "
        f"{mtbf_s / HOUR_S:,.1f} h on {cluster.world_size} device(s) at {rate:.3g} failures per "
        "device-hour"
    )
    if run_steps is not None and steps >= run_steps:
        return (
            f"checkpoint suggestion: none before the final one ({why}: {steps:,} steps, no "
            f"shorter than this run's {run_steps:,})"
        )
    return f"checkpoint suggestion: train.ckpt_every = {steps} (train.ckpt_every is unset; {why})"


def _duration(seconds: float) -> str:
    """'115.1 s', '12 ms', '0.35 ms': two significant figures below a second."""
    return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds * 1e3:.2g} ms"
