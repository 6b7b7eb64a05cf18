"""How far to trust one prediction: an error band, the calibrated domain, the nearest published run.

Residuals. r = predicted / measured - 1 of the step time on rows the model was *not* fitted to:
`fivefold.planner.rates.efficiency.held_out_errors()` -> {source: [(row, r)]}, leave-one-source-out
(each publication's rows predicted by the model fitted on the others; `held_out_residuals`).

Band. r_lo and r_hi are the 10th and 90th percentiles of the residuals, every source weighted
equally (a source of 25 rows counts as much as one of a single row; `COVERAGE` = 0.8 of the
weight lies between them), widened to include 0. A prediction T inside the calibrated domain
then means the measured step lies, as it did for 80 % of the held-out sources' weight, in
    [T / (1 + r_hi), T / (1 + r_lo)]
(measured = predicted / (1 + r)). Outside it, each doubling beyond the domain multiplies the
pessimistic end by (1 + WIDENING_PER_DOUBLING) and divides the optimistic end by it:
    [T / (1 + r_hi) / (1 + w)^d,  T / (1 + r_lo) * (1 + w)^d].
w = 5 % per doubling is a judgement, not a fit: a held-out source's error grows with its distance
from the sources the model was fitted to, and the calibration set has too few far rows to fit it.

Domain. A layout is the point (tp, pp, dp, cp, ep, tokens per GPU per micro-batch
(micro_batch * seq_len / cp), parameters) plus its GPU architecture; the calibrated domain is
the box spanned by the published rows in each of those dimensions and the set of their
architectures. The distance of a layout from the domain is
    d = sum over dimensions of max(0, log2(lo / x), log2(x / hi))  +  1 if the arch is new,
in doublings (0 inside). The distance between a layout and one published row is
sum |log2 x - log2 y| + 1 if the architectures differ; the nearest run minimises it.
The search ranks by the pessimistic end of the band (`risk` = "pessimistic", the default) or by
the prediction itself ("expected"); `rank_tokens_per_s` is that key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fivefold.planner.budget.published import run_setups
from fivefold.planner.rates import efficiency
from fivefold.planner.rates.device import rates_for
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import rank_tokens
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.plan import ParallelPlan

RISKS = ("pessimistic", "expected")
DEFAULT_RISK = "pessimistic"
WIDENING_PER_DOUBLING = 0.05
COVERAGE = 0.8  # the band spans the central 80 % of the held-out residuals' weight
DIMENSIONS = ("tp", "pp", "dp", "cp", "ep", "tokens_per_gpu", "params")
DIMENSION_WORDS = {
    "tp": "TP",
    "pp": "PP",
    "dp": "DP",
    "cp": "CP",
    "ep": "EP",
    "tokens_per_gpu": "tokens per GPU per micro-batch",
    "params": "parameters",
}


# ---- residuals ---------------------------------------------------------------------------------
RESIDUAL_KIND = "leave-one-source-out"  # how the residuals were held out of the fit


def held_out_residuals() -> dict[str, list[tuple[str, float]]]:
    """{source: [(row, r)]}: the calibration's leave-one-source-out errors."""
    loso = efficiency.held_out_errors()
    return {str(k): [(str(row), float(r)) for row, r in v] for k, v in loso.items()}


def source_key(row: dict) -> str:
    return row.get("source_key") or row["source"].split(" (")[0].split(",")[0]


@lru_cache(maxsize=1)
def residual_range() -> tuple[float, float]:
    """(r_lo, r_hi) of the calibration's held-out residuals (module docstring)."""
    return residual_bounds(held_out_residuals())


def residual_bounds(
    by_source: dict[str, list[tuple[str, float]]], coverage: float = COVERAGE
) -> tuple[float, float]:
    """The (1 - coverage)/2 and (1 + coverage)/2 quantiles of the residuals, each source's rows
    sharing one unit of weight, widened to include 0."""
    weighted = sorted(
        (r, 1.0 / len(rows) / len(by_source)) for rows in by_source.values() for _, r in rows
    )
    tail = (1 - coverage) / 2
    return min(0.0, _quantile(weighted, tail)), max(0.0, _quantile(weighted, 1 - tail))


def _quantile(weighted: list[tuple[float, float]], q: float) -> float:
    """The first value whose cumulative weight reaches q (weights sum to 1), 0 if empty."""
    total = 0.0
    for value, weight in weighted:
        total += weight
        if total >= q - 1e-12:
            return value
    return weighted[-1][0] if weighted else 0.0


# ---- the domain ------------------------------------------------------------------------------
def layout_point(model: ModelSpec, plan: ParallelPlan) -> dict[str, float]:
    """The layout's coordinates in the calibrated domain (see the module docstring)."""
    return {
        "tp": plan.tp,
        "pp": plan.pp,
        "dp": plan.dp,
        "cp": plan.cp,
        "ep": plan.ep,
        "tokens_per_gpu": rank_tokens(plan.micro_batch, model.seq_len, plan),
        "params": float(param_count(model)),
    }


@dataclass(frozen=True)
class Domain:
    """The box the published rows span, and their GPU architectures."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    archs: frozenset[str]

    @classmethod
    def of(cls, points: list[dict[str, float]], archs: set[str]) -> Domain:
        return cls(
            tuple(min(p[k] for p in points) for k in DIMENSIONS),
            tuple(max(p[k] for p in points) for k in DIMENSIONS),
            frozenset(archs),
        )

    def excess(self, point: dict[str, float], arch: str) -> dict[str, float]:
        """Doublings beyond the box per dimension (only those outside), "gpu" for a new arch."""
        out = {}
        for k, lo, hi in zip(DIMENSIONS, self.low, self.high, strict=True):
            d = max(math.log2(lo / point[k]), math.log2(point[k] / hi), 0.0)
            if d > 0:
                out[k] = d
        if arch not in self.archs:
            out["gpu"] = 1.0
        return out

    def distance(self, point: dict[str, float], arch: str) -> float:
        return sum(self.excess(point, arch).values())

    def describe(self, point: dict[str, float], arch: str) -> list[str]:
        """'CP 8 above the calibrated 1-1'-style words for every dimension outside."""
        words = []
        for k, d in self.excess(point, arch).items():
            if k == "gpu":
                words.append(f"GPU architecture {arch or 'unknown'} not in {sorted(self.archs)}")
                continue
            i = DIMENSIONS.index(k)
            lo, hi = self.low[i], self.high[i]
            side = "above" if point[k] > hi else "below"
            words.append(
                f"{DIMENSION_WORDS[k]} {_num(point[k])} {side} the calibrated "
                f"{_num(lo)}-{_num(hi)} ({d:.1f} doublings)"
            )
        return words


def run_distance(a: dict[str, float], arch_a: str, b: dict[str, float], arch_b: str) -> float:
    """Distance between two layouts: sum |log2 a - log2 b| over the dimensions, + 1 if the GPU
    architectures differ."""
    d = sum(abs(math.log2(a[k] / b[k])) for k in DIMENSIONS)
    return d + (0.0 if arch_a == arch_b else 1.0)


@lru_cache(maxsize=1)
def calibration_points() -> tuple[tuple[Any, dict[str, float], str], ...]:
    """(setup, point, arch) of every published row (`planner.budget.published.RunSetup`)."""
    return tuple((s, layout_point(s.model, s.plan), s.cluster.device.arch) for s in run_setups())


@lru_cache(maxsize=1)
def calibrated_domain() -> Domain:
    rows = calibration_points()
    return Domain.of([p for _, p, _ in rows], {a for _, _, a in rows})


@lru_cache(maxsize=65536)
def domain_distance(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan) -> float:
    return calibrated_domain().distance(layout_point(model, plan), cluster.device.arch)


def nearest_run(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan) -> tuple[Any, float]:
    """(RunSetup, distance) of the published row closest to the layout."""
    point, arch = layout_point(model, plan), cluster.device.arch
    return min(
        ((s, run_distance(point, arch, p, a)) for s, p, a in calibration_points()),
        key=lambda pair: pair[1],
    )


def published_layouts(model: ModelSpec, cluster: ClusterSpec) -> list[Any]:
    """Published rows of this very model (architecture and sequence) on this GPU type and count."""
    key = _model_key(model)
    return [
        s
        for s, _, _ in calibration_points()
        if _model_key(s.model) == key
        and s.cluster.gpu == cluster.gpu
        and s.cluster.world_size == cluster.world_size
    ]


def _model_key(m: ModelSpec) -> tuple:
    return (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.seq_len, m.experts)


# ---- the band ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Band:
    """Where the measured step time should lie, seconds; `distance` in doublings."""

    step_time_s: float
    low_s: float
    high_s: float
    distance: float

    @property
    def outside(self) -> bool:
        return self.distance > 0

    def mfu_range(self, mfu: float) -> tuple[float, float]:
        """(pessimistic, optimistic) MFU for the prediction's `mfu`."""
        return mfu * self.step_time_s / self.high_s, mfu * self.step_time_s / self.low_s

    def to_json(self) -> dict:
        return {
            "step_time_s": [self.low_s, self.high_s],
            "distance_doublings": self.distance,
            "outside_calibrated_domain": self.outside,
        }


def band_of(
    step_time_s: float,
    residuals: tuple[float, float],
    distance: float,
    widening: float = WIDENING_PER_DOUBLING,
) -> Band:
    """The band of a prediction `step_time_s` from (r_lo, r_hi) and the domain distance."""
    r_lo, r_hi = residuals
    grow = (1 + widening) ** distance
    return Band(
        step_time_s,
        step_time_s / (1 + r_hi) / grow,
        step_time_s / (1 + r_lo) * grow,
        distance,
    )


def published_band_applies(cluster: ClusterSpec) -> bool:
    """Whether the published runs' residuals say anything about `cluster`: they do for catalog
    GPUs; a device measured by `fivefold calibrate` runs fivefold's own runtime, whose errors
    are those of `benchmarks/plan_vs_run.py` on that machine (docs/planner.md), not these."""
    return not rates_for(cluster.device).calibrated


def band(est: Any) -> Band | None:
    """The band of an `Estimate` (None on a measured device: `published_band_applies`)."""
    if not published_band_applies(est.cluster):
        return None
    d = domain_distance(est.model, est.cluster, est.plan)
    return band_of(est.step_time_s, residual_range(), d)


def band_json(est: Any) -> dict:
    """`band(est)` for `--json`, or why there is none."""
    b = band(est)
    if b is not None:
        return b.to_json()
    return {
        "step_time_s": None,
        "why_none": "a measured device: checked against fivefold's own runs "
        "(benchmarks/plan_vs_run.py), not against published GPU runs",
    }


def rank_factor(model: ModelSpec, cluster: ClusterSpec, plan: ParallelPlan, risk: str) -> float:
    """Ranked tokens/s over predicted tokens/s: 1 for "expected" and on a measured device
    (no published band applies), predicted step / the band's slow end for "pessimistic"
    (known before the estimate, so the search's bounds use it too)."""
    if risk == "expected" or not published_band_applies(cluster):
        return 1.0
    r_lo, _ = residual_range()
    return (1 + r_lo) / (1 + WIDENING_PER_DOUBLING) ** domain_distance(model, cluster, plan)


def rank_tokens_per_s(est: Any, risk: str = DEFAULT_RISK) -> float:
    """What the search ranks by: predicted tokens/s, or tokens/s at the band's slow end."""
    return float(est.tokens_per_s) * rank_factor(est.model, est.cluster, est.plan, risk)


def risk_problems(risk: str) -> list[str]:
    if risk in RISKS:
        return []
    return [
        f"risk = {risk!r}: choose 'pessimistic' (rank by the slow end of each layout's error "
        "band, the default) or 'expected' (rank by the prediction itself)."
    ]


def _num(x: float) -> str:
    if x >= 1e9:
        return f"{x / 1e9:.3g}B"
    return f"{x:,.0f}"
