"""What a layout search produces: each candidate's outcome, the batch target, the ranking.

The search (`planner.search.layouts`) fills these; the explanation (`planner.explain.result`)
and the callers read them. The rules (tie band, tolerance, order of rejections) are in
docs/planner.md, "The layout search".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.budget.uncertainty import DEFAULT_RISK, rank_tokens_per_s
from fivefold.planner.options import PlannerOptions
from fivefold.specs.batch import grad_accum_for
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.units import GiB

DEFAULT_BATCH_TOKENS = 4 * 2**20  # ~4M tokens: Llama-scale practice
BATCH_TOLERANCE = 0.05
TIE_FRACTION = 0.005  # layouts this close to the fastest tie; the smaller memory wins
KEEP_REJECTED = 40


@dataclass
class Outcome:
    """What became of one candidate: an estimate (it fits), or a rejection reason."""

    plan: ParallelPlan
    estimate: Any = None  # fivefold.planner.estimate.Estimate when it fits
    reason: str = ""
    kind: str = ""  # "fits" | "memory" | "batch" | "invalid"
    overflow_bytes: float = 0.0  # memory rejections: worst stage minus the usable HBM

    @property
    def fits(self) -> bool:
        return self.kind == "fits"


@dataclass(frozen=True)
class BatchTarget:
    """The global batch asked for, in sequences, and how far the layout may miss it."""

    sequences: float
    seq_len: int
    tolerance: float = BATCH_TOLERANCE

    @property
    def tokens(self) -> float:
        return self.sequences * self.seq_len

    def accumulation(self, micro_batch: int, dp: int) -> int | None:
        """Micro-batches per step reaching the target within tolerance, or None."""
        return grad_accum_for(self.sequences, micro_batch, dp, self.tolerance)

    def within(self, sequences: int) -> bool:
        return abs(sequences - self.sequences) <= self.tolerance * self.sequences + 1e-9


def batch_target(
    model: ModelSpec,
    global_batch_tokens: int | None,
    global_batch: int | None,
    tolerance: float = BATCH_TOLERANCE,
) -> BatchTarget:
    """The target in sequences from tokens or sequences (4M tokens when neither is given)."""
    if global_batch_tokens is not None and global_batch is not None:
        raise ConfigError(
            "give the batch target once: --global-batch-tokens (tokens) or --global-batch "
            "(sequences), not both."
        )
    if not 0 <= tolerance < 1:
        raise ConfigError(f"batch tolerance = {tolerance}: must be in [0, 1), e.g. 0.05.")
    if global_batch is not None:
        if global_batch < 1:
            raise ConfigError(f"--global-batch = {global_batch}: must be at least 1 sequence.")
        return BatchTarget(float(global_batch), model.seq_len, tolerance)
    tokens = DEFAULT_BATCH_TOKENS if global_batch_tokens is None else global_batch_tokens
    if tokens < model.seq_len:
        raise ConfigError(
            f"--global-batch-tokens = {tokens}: must be at least one sequence of "
            f"model.seq_len = {model.seq_len} tokens."
        )
    return BatchTarget(tokens / model.seq_len, model.seq_len, tolerance)


@dataclass
class SearchResult:
    """The fastest layout, the runners-up, the nearest rejections and why, and the search state
    that the explanation (`fivefold.planner.explain.result.explain`) questions further."""

    model: ModelSpec
    cluster: ClusterSpec
    best: Any  # Estimate
    best_plan: ParallelPlan
    alternatives: list[Any]  # Estimates, fastest first (best excluded)
    rejected: list[tuple[ParallelPlan, str]]
    target: BatchTarget
    headroom: float  # share of HBM left free
    evaluated: int  # full estimates computed
    considered: int = 0  # candidates looked at (including pruned ones)
    elapsed_s: float = 0.0
    outcomes: dict[ParallelPlan, Outcome] = field(default_factory=dict, repr=False)
    search_state: Any = field(default=None, repr=False)  # the search, for the explanation
    pruned_by_bound: int = 0
    options: PlannerOptions = field(default_factory=PlannerOptions)
    risk: str = DEFAULT_RISK
    # When only the memory levers made a layout fit: the closest layout without them.
    without_levers: Outcome | None = None


# ---- ranking -------------------------------------------------------------------------------
def rank_fitting(outcomes: list[Outcome], risk: str = DEFAULT_RISK) -> list[Outcome]:
    """Fastest first by the risk's key (`uncertainty.rank_tokens_per_s`); within TIE_FRACTION of
    the fastest, the smaller memory wins the top spot."""
    key = {id(o): rank_tokens_per_s(o.estimate, risk) for o in outcomes}
    fits = sorted(outcomes, key=lambda o: -key[id(o)])
    if not fits:
        return fits
    fastest = key[id(fits[0])]
    tied = [o for o in fits if key[id(o)] >= fastest * (1 - TIE_FRACTION)]
    winner = min(tied, key=lambda o: (float(o.estimate.peak_memory_bytes), -key[id(o)]))
    return [winner] + [o for o in fits if o is not winner]


def nearest_rejected(outcomes: list[Outcome], keep: int = KEEP_REJECTED) -> list[Outcome]:
    """Memory rejections by smallest overflow, then batch misses, then invalid layouts."""
    order = {"memory": 0, "batch": 1, "invalid": 2}
    rejected = [o for o in outcomes if not o.fits]
    rejected.sort(key=lambda o: (order.get(o.kind, 3), o.overflow_bytes))
    return rejected[:keep]


# ---- reasons, in words ---------------------------------------------------------------------
def memory_reason(need: float, stage: int | None, hbm: float, headroom: float) -> str:
    """'out of memory by 2.1 GiB: pipeline stage 0 needs ...' (stage None: a lower bound)."""
    budget = hbm * (1.0 - headroom)
    where = f"pipeline stage {stage} needs" if stage is not None else "needs at least"
    return (
        f"out of memory by {'at least ' if stage is None else ''}"
        f"{_amount(need - budget)}: {where} {need / GiB:.1f} GiB of "
        f"{budget / GiB:.1f} GiB usable ({hbm / GiB:.0f} GiB HBM less "
        f"{headroom:.0%} headroom)"
    )


def host_memory_reason(host: Any) -> str:
    """Why offloading does not fit the node's host RAM (`host` a `HostMemory`)."""
    return (
        f"out of host memory by {_amount(host.overflow_bytes)}: offloading puts "
        f"{host.per_node_bytes / GiB:,.0f} GiB on each node of "
        f"{host.usable_bytes / GiB:,.0f} GiB usable ({host.system}, "
        f"{host.node_ram_bytes / GiB:,.0f} GiB less the reserve for the system)"
    )


def no_layout_message(
    model: ModelSpec,
    cluster: ClusterSpec,
    target: BatchTarget,
    headroom: float,
    rejected: list[Outcome],
) -> str:
    head = (
        f"no layout of {model.name} fits {cluster.world_size} x {cluster.gpu} with "
        f"{headroom:.0%} headroom at a global batch of {target.sequences:g} sequences "
        f"({target.tokens:,.0f} tokens)."
    )
    if not rejected:
        return head + " No candidate layout exists: check the GPU count against the model's heads."
    closest = rejected[0]
    fix = (
        "Add GPUs, lower the headroom (--headroom), use a smaller sequence or micro-batch, "
        "or change the batch target (--global-batch-tokens)."
    )
    return f"{head} Closest: {closest.plan.describe()}: {closest.reason}. {fix}"


def _amount(num_bytes: float) -> str:
    """Bytes in GiB with one decimal, or in MiB below 0.1 GiB (never "0.0 GiB")."""
    if num_bytes >= 0.1 * GiB:
        return f"{num_bytes / GiB:.1f} GiB"
    return f"{max(num_bytes / 2**20, 0.1):.1f} MiB"
