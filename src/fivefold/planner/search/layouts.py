"""The layout search: every valid way to run a model on a cluster, ranked by predicted tokens/s.

`search` walks the choices of `candidates`, prunes by batch, a memory lower bound and dominance,
costs the rest best bound first and returns a `SearchResult` (`outcomes`); the explanation
(`explain`) questions its state further. The rules are in docs/planner.md, "The layout search".
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.budget.uncertainty import DEFAULT_RISK, risk_problems
from fivefold.planner.options import PlannerOptions
from fivefold.planner.request import (
    DEFAULT_HEADROOM,
    DEFAULT_PRECISIONS,
    DEFAULT_TOP,
)
from fivefold.planner.search.candidates import lever_probe, lever_sets
from fivefold.planner.search.outcomes import (
    BATCH_TOLERANCE,
    SearchResult,
    batch_target,
    nearest_rejected,
    no_layout_message,
    rank_fitting,
)
from fivefold.planner.search.state import SearchState
from fivefold.specs.cluster import ClusterSpec, require_hbm
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import RECIPES

PLAN_FIELDS = tuple(ParallelPlan.__dataclass_fields__)
FIXABLE = (*PLAN_FIELDS, "dp")  # "dp" pins dp_replicate * dp_shard


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    global_batch_tokens: int | None = None,
    global_batch: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    top: int = DEFAULT_TOP,
    batch_tolerance: float = BATCH_TOLERANCE,
    precisions: tuple[str, ...] | list[str] = DEFAULT_PRECISIONS,
    fixed: dict[str, Any] | None = None,
    options: PlannerOptions | None = None,
    risk: str = DEFAULT_RISK,
) -> SearchResult:
    """Search every valid layout of `model` on `cluster` (docs/planner.md, "The layout search").

    `fixed` pins plan fields (e.g. {"tp": 8}); `precisions` lists the recipes to consider;
    `options` are the software assumptions every candidate is costed with (default
    `PlannerOptions.for_device(cluster.device)`, as `estimate` uses); `risk` is "pessimistic"
    (rank by the slow end of each layout's error band, the default) or "expected". Raises
    `ConfigError` when the inputs are wrong or no layout fits, with what came closest. The
    explanation is `fivefold.planner.explain.result.explain(result)`.
    """
    with collector_paused():
        started = time.perf_counter()
        fixed = dict(fixed or {})
        opts = options or PlannerOptions.for_device(cluster.device)
        problems = _input_problems(
            model, cluster, headroom, top, precisions, fixed, risk, opts.fivefold_runtime
        )
        problems += opts.memory().problems()
        if problems:
            raise ConfigError(problems)
        require_hbm(cluster)
        target = batch_target(model, global_batch_tokens, global_batch, batch_tolerance)
        state = SearchState(
            model, cluster, target, headroom, tuple(precisions), fixed, top, opts, risk
        )
        result = _passes(state)
        result.elapsed_s = time.perf_counter() - started
        return result


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the search, as it was after.

    A search allocates a few hundred thousand tuples (plans, cache keys, schedule action lists)
    and no reference cycles: what it drops, reference counting frees; what it keeps (caches,
    the result) lives on. Left on, the collector scans them again and again (about a quarter of
    the search's time on Llama 3 405B at 16,384 GPUs); re-enabled as is, it would scan them all
    once more at the next allocation, so they are first moved out of its reach (`gc.freeze`).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()


def _input_problems(
    model: ModelSpec,
    cluster: ClusterSpec,
    headroom: float,
    top: int,
    precisions: tuple[str, ...] | list[str],
    fixed: dict[str, Any],
    risk: str,
    runtime: bool = True,
) -> list[str]:
    """What is wrong with the search's inputs, and what the runtime refuses around the pins
    (`runtime`: when its rules bind, `PlannerOptions.fivefold_runtime`)."""
    problems = model.problems() + cluster.problems()
    if not 0 <= headroom < 1:
        problems.append(f"headroom = {headroom}: must be in [0, 1), e.g. 0.1 for 10 %.")
    if top < 1:
        problems.append(f"top = {top}: must be at least 1.")
    problems += risk_problems(risk)
    for p in precisions:
        if p not in RECIPES:
            problems.append(f"precision {p!r} is unknown; choose from {', '.join(RECIPES)}.")
    for name in fixed:
        if name not in FIXABLE:
            problems.append(
                f"fixed plan field {name!r} is not a plan setting; known: {', '.join(FIXABLE)}."
            )
    if not problems:  # what the runtime refuses whatever the search picks around the pins
        pins = lever_probe({k: v for k, v in fixed.items() if k in PLAN_FIELDS})
        problems += pins.device_problems(cluster)
        if runtime:
            problems += pins.with_(precision="fp32").runtime_problems(model)
            by_precision = [ParallelPlan(precision=p).runtime_problems() for p in precisions]
            if all(by_precision):
                problems += [p for found in by_precision for p in found]
        unpriced = [_unmeasured(cluster, p) for p in precisions]
        if all(unpriced):
            problems += unpriced
    return problems


def _unmeasured(cluster: ClusterSpec, precision: str) -> str:
    """Why a device profile cannot price `precision` (its compute dtype was never measured
    there), naming the precision that fixes it; "" when it can."""
    device = cluster.device
    dtype = RECIPES[precision].compute_dtype
    if device.rank_profile is None or dtype in device.peak_flops:
        return ""
    measured = sorted(device.peak_flops)
    fits = [name for name, r in RECIPES.items() if r.compute_dtype in device.peak_flops]
    fix = f"plan with --precision {fits[0]} ([plan] precision = {fits[0]!r}), or " if fits else ""
    return (
        f"precision {precision!r} computes in {dtype}, and the device profile of {device.name} "
        f"has no {dtype} matmul measurement (measured: {', '.join(measured) or 'none'}): "
        f"{fix}re-run `fivefold calibrate` on a machine that computes {dtype} natively."
    )


def _passes(state: SearchState) -> SearchResult:
    """The first pass; when nothing fits, a second over the same layouts with the memory levers."""
    model, cluster, fixed = state.model, state.cluster, state.fixed
    state.run()
    _refuse_broken(state)
    ranked = rank_fitting([o for o in state.outcomes.values() if o.fits], state.risk)
    rejected = nearest_rejected(list(state.outcomes.values()))
    without_levers = None
    optimizer, rules = state.options.optimizer, state.runtime_rules
    sets = lever_sets(model, cluster, fixed, optimizer, rules) if not ranked else ()
    if sets:
        without_levers = rejected[0] if rejected else None
        first = state
        state = SearchState(
            model,
            cluster,
            first.target,
            first.headroom,
            first.precisions,
            fixed,
            first.top,
            first.options,
            first.risk,
            lever_sets=sets,
        )
        state.run()
        ranked = rank_fitting([o for o in state.outcomes.values() if o.fits], state.risk)
        rejected = nearest_rejected(list(state.outcomes.values())) if ranked else rejected
    if not ranked:
        message = no_layout_message(model, cluster, state.target, state.headroom, rejected)
        if sets:
            tried = "; ".join(", ".join(f"{k} {v}" for k, v in lv.items()) for lv in sets)
            message += f" The memory levers did not make any layout fit either ({tried})."
        raise ConfigError(message)
    return SearchResult(
        model=model,
        cluster=cluster,
        best=ranked[0].estimate,
        best_plan=ranked[0].plan,
        alternatives=[o.estimate for o in ranked[1 : state.top]],
        rejected=[(o.plan, o.reason) for o in rejected],
        evaluated=state.evaluated,
        considered=state.considered,
        target=state.target,
        headroom=state.headroom,
        outcomes=state.outcomes,
        search_state=state,
        pruned_by_bound=state.pruned_by_bound,
        options=state.options,
        risk=state.risk,
        without_levers=without_levers,
    )


def _refuse_broken(state: SearchState) -> None:
    """Raise when every layout breaks a rule (a pinned degree): no memory lever can help."""
    broken = state.broken_rules()
    if not broken:
        return
    model, cluster = state.model, state.cluster
    pinned = ", ".join(f"{k} {v}" for k, v in state.fixed.items())
    where = f"{model.name} on {cluster.world_size} x {cluster.gpu}"
    head = (
        f"no layout of {where} with the pinned fields ({pinned}) can run: every one "
        "breaks a rule; change a pinned value."
        if pinned
        else f"no layout of {where} can run: every one breaks a rule."
    )
    raise ConfigError([head, *broken])
