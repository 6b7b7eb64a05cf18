"""The layout search: every valid way to run a model on a cluster, ranked by predicted tokens/s.

`search` enumerates tp, cp, pp, the DP split with its ZeRO stage, ep, the schedule, precision,
micro-batch and recompute, prunes by batch, a memory lower bound and dominance, costs the rest
best bound first and returns a `SearchResult` (`fivefold.planner.outcomes`); the explanation
(`fivefold.planner.explain`) questions its state further. The rules are in docs/planner.md,
"The layout search". Over 500 lines: the enumeration and the bounded search that walks it are
one concept (the result, ranking and reasons are in `outcomes`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.bounds import Bounds
from fivefold.planner.options import PlannerOptions
from fivefold.planner.outcomes import (
    BATCH_TOLERANCE,
    TIE_FRACTION,
    BatchTarget,
    Outcome,
    SearchResult,
    batch_target,
    host_memory_reason,
    memory_reason,
    nearest_rejected,
    no_layout_message,
    rank_fitting,
)
from fivefold.planner.request import (
    DEFAULT_HEADROOM,
    DEFAULT_PRECISIONS,
    DEFAULT_TOP,
    require_hbm,
)
from fivefold.planner.schedule import build_schedule
from fivefold.planner.uncertainty import (
    DEFAULT_RISK,
    rank_factor,
    rank_tokens_per_s,
    risk_problems,
)
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.geometry import RECOMPUTE_POLICIES, ep_fits
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import RECIPES

MIN_CP_TOKENS = 1024
VPP_CHOICES = (2, 4, 8)
MAX_MICRO_BATCH = 64
# Memory levers, tried only when no layout fits without them, cheapest first in
# what they cost a step; only those fivefold's runtime runs (`ParallelPlan.runtime_problems`).
# FP8 compute changes the numerics: it is searched only when asked for (pinned, e.g. --fp8).
LEVER_FIELDS = ("offload", "optimizer_states", "fp8")
AUTO_LEVERS: tuple[dict[str, str], ...] = (
    {"optimizer_states": "8bit"},
    {"offload": "optimizer"},
    {"offload": "all"},
    {"optimizer_states": "8bit", "offload": "optimizer"},
    {"optimizer_states": "8bit", "offload": "all"},
)

PLAN_FIELDS = tuple(ParallelPlan.__dataclass_fields__)
FIXABLE = (*PLAN_FIELDS, "dp")  # "dp" pins dp_replicate * dp_shard


# ---- enumeration ---------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    out = []
    for tp in divisors(cluster.nvlink_gpus):  # one node, or a larger NVLink domain (NVL72)
        if cluster.world_size % tp or model.heads % tp or model.ffn % tp:
            continue
        kv_ok = model.kv_heads % tp == 0 if tp <= model.kv_heads else tp % model.kv_heads == 0
        if kv_ok and (not model.is_moe or model.expert_ffn % tp == 0):
            out.append(tp)
    return out


def cp_choices(model: ModelSpec, rest: int) -> list[int]:
    return [
        cp
        for cp in divisors(rest)
        if cp == 1 or (model.seq_len % (2 * cp) == 0 and model.seq_len // cp >= MIN_CP_TOKENS)
    ]


def dp_splits(
    dp: int, cp: int, tp: int = 1, gpus_per_node: int = 8, with_plain: bool = False
) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero): ZeRO 1-3 over every DP (x CP) rank, and HSDP.

    Plain DP (zero 0) is left out unless asked for (`with_plain`) or nothing can be sharded: a
    reduce-scatter plus an all-gather moves the same bytes as the all-reduce it replaces, so
    ZeRO-1 costs the same time and saves the optimizer state.
    """
    if dp * cp == 1:
        return [(1, 1, 0)]
    out = [(dp, 1, 0)] if with_plain else []
    out += [(1, dp, zero) for zero in (1, 2, 3)]
    out += [(dp // s, s, 3) for s in hsdp_shards(dp, cp, tp, gpus_per_node)]
    return out


def hsdp_shards(dp: int, cp: int, tp: int, gpus_per_node: int) -> list[int]:
    """HSDP shard sizes: groups spanning 1, 2, 4 or 8 whole nodes (at least 2, fewer than dp).

    Sharding inside a few nodes keeps the per-layer gathers off most of the network while the
    replicas only all-reduce gradients once per step; smaller or odd-sized groups are never
    better than one of these, or than ZeRO-3 over all DP ranks.
    """
    out = []
    for nodes in (1, 2, 4, 8):
        shard, rest = divmod(nodes * gpus_per_node, tp * cp)
        if rest == 0 and 1 < shard < dp and dp % shard == 0:
            out.append(shard)
    return out


def ep_choices(model: ModelSpec, dp_shard: int, cp: int) -> list[int]:
    if not model.is_moe:
        return [1]
    return [ep for ep in divisors(model.experts) if ep_fits(ep, dp_shard, cp)]


def schedule_choices(model: ModelSpec, pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    out += [("interleaved-1f1b", v) for v in VPP_CHOICES if pp * v <= model.layers]
    if 2 * pp <= model.layers:
        # DualPipeV differs from ZBV by hiding expert all-to-alls behind compute; for a dense
        # model it has the same bubble and one more chunk of activations in flight.
        out += [("zbv", 2), ("dualpipev", 2)] if model.is_moe else [("zbv", 2)]
    return out


def micro_batch_choices(target: BatchTarget, dp: int) -> list[int]:
    """Powers of two up to what one step of the target gives each DP rank."""
    most = max(1, math.floor(target.sequences * (1 + target.tolerance) / dp))
    out, mbs = [], 1
    while mbs <= min(most, MAX_MICRO_BATCH):
        out.append(mbs)
        mbs *= 2
    return out


# ---- the search ----------------------------------------------------------------------------
@dataclass
class _Candidate:
    upper_tokens_per_s: float
    plan: ParallelPlan


@dataclass
class _Search:
    model: ModelSpec
    cluster: ClusterSpec
    target: BatchTarget
    headroom: float
    precisions: tuple[str, ...]
    fixed: dict[str, Any]
    top: int = 5
    options: PlannerOptions = field(default_factory=PlannerOptions)
    risk: str = DEFAULT_RISK
    lever_sets: tuple[dict[str, str], ...] = ({},)  # memory levers tried on every layout
    outcomes: dict[ParallelPlan, Outcome] = field(default_factory=dict)
    candidates: list[_Candidate] = field(default_factory=list)
    evaluated: int = 0
    considered: int = 0
    pruned_by_bound: int = 0

    def __post_init__(self) -> None:
        self.bounds = Bounds(self.model, self.cluster, self.options)
        self.lever_pins = {k: self.fixed[k] for k in LEVER_FIELDS if k in self.fixed}

    @property
    def budget_bytes(self) -> float:
        return self.cluster.device.hbm_bytes * (1.0 - self.headroom)

    def allowed(self, name: str, value: Any) -> bool:
        return name not in self.fixed or self.fixed[name] == value

    def tried(self, name: str, found: list[int]) -> list[tuple[int, bool]]:
        """(value, whether the enumeration found it) of degree `name`: `found`, or the pinned
        value, even one the enumeration would skip, so that validation says why it cannot run."""
        if name in self.fixed:
            return [(self.fixed[name], self.fixed[name] in found)]
        return [(v, True) for v in found]

    def run(self) -> None:
        """Enumerate and screen every candidate, then cost them best bound first."""
        world = self.cluster.world_size
        for tp, tp_found in self.tried("tp", tp_choices(self.model, self.cluster)):
            for cp, cp_found in self.tried("cp", cp_choices(self.model, max(1, world // tp))):
                pps = [p for p in divisors(max(1, world // (tp * cp))) if p <= self.model.layers]
                for pp, pp_found in self.tried("pp", pps):
                    dp = max(1, world // (tp * cp * pp))
                    if not self.allowed("dp", dp):
                        continue
                    if not (tp_found and cp_found and pp_found) and self.broken(tp, cp, pp, dp):
                        continue
                    self.shape(tp, cp, pp, dp)
        if not self.outcomes and not self.candidates:  # e.g. a pinned dp no shape reaches
            tp, cp, pp = (self.fixed.get(k, 1) for k in ("tp", "cp", "pp"))
            self.broken(tp, cp, pp, self.fixed.get("dp", max(1, world // (tp * cp * pp))))
        self.cost_candidates()

    def broken(self, tp: int, cp: int, pp: int, dp: int) -> bool:
        """Whether a shape with a pinned degree the enumeration skips breaks a rule of
        `ParallelPlan.problems` (then rejected as invalid, with the rule's words)."""
        sp = self.fixed.get("sp", tp > 1)
        shape = ParallelPlan(tp=tp, sp=sp, cp=cp, pp=pp, dp_replicate=dp)
        problems = shape.problems(self.model, self.cluster)
        if problems:
            self.reject(shape, "invalid", " ".join(problems))
        return bool(problems)

    def broken_rules(self) -> list[str]:
        """When every layout tried is invalid (a pinned degree the model or cluster cannot
        take): the rules (`ParallelPlan.problems`) all of them break, else the first one's;
        empty when some layout is valid or none was tried."""
        outcomes = list(self.outcomes.values())
        if not outcomes or any(o.kind != "invalid" for o in outcomes):
            return []
        lists = [o.plan.problems(self.model, self.cluster) for o in outcomes]
        common = [p for p in lists[0] if all(p in rest for rest in lists[1:])]
        return common or lists[0]

    def shape(self, tp: int, cp: int, pp: int, dp: int) -> None:
        if dp > self.target.sequences * (1 + self.target.tolerance):
            plan = ParallelPlan(tp=tp, cp=cp, pp=pp, dp_replicate=dp)
            self.reject(
                plan,
                "batch",
                f"DP = {dp} ranks x 1 sequence = {dp} sequences already exceeds the target of "
                f"{self.target.sequences:g} sequences per step",
            )
            return
        splits = dp_splits(dp, cp, tp, self.cluster.gpus_per_node, self.fixed.get("zero") == 0)
        if "dp_shard" in self.fixed and self.fixed["dp_shard"] not in [s[1] for s in splits]:
            shard = self.fixed["dp_shard"]
            if dp % shard == 0 and 1 < shard < dp:
                splits.append((dp // shard, shard, 3))
        for dp_replicate, dp_shard, zero in splits:
            if not (self.allowed("zero", zero) and self.allowed("dp_shard", dp_shard)):
                continue
            if not self.allowed("dp_replicate", dp_replicate):
                continue
            for ep in ep_choices(self.model, dp_shard, cp):
                if not self.allowed("ep", ep):
                    continue
                for schedule, vpp in schedule_choices(self.model, pp):
                    if not (self.allowed("schedule", schedule) and self.allowed("vpp", vpp)):
                        continue
                    for precision in self.precisions:
                        base = ParallelPlan(
                            tp=tp,
                            sp=tp > 1,
                            pp=pp,
                            vpp=vpp,
                            schedule=schedule,
                            dp_replicate=dp_replicate,
                            dp_shard=dp_shard,
                            zero=zero,
                            cp=cp,
                            ep=ep,
                            precision=precision,
                        )
                        if "sp" in self.fixed:
                            base = base.with_(sp=self.fixed["sp"])
                        for levers in self.lever_sets:
                            self.with_levers(base, {**self.lever_pins, **levers})

    def with_levers(self, base: ParallelPlan, levers: dict[str, str]) -> None:
        """The micro-batches of `base` with memory levers; none where the levers do not fit
        this layout (e.g. offload "all" needs ZeRO-3: a rule of the plan, not a rejection)."""
        plan = base.with_(**levers) if levers else base
        if levers and plan.problems(runtime=False) and not base.problems(runtime=False):
            return
        self.micro_batches(plan)

    def micro_batches(self, base: ParallelPlan) -> None:
        for mbs in micro_batch_choices(self.target, base.dp):
            if not self.allowed("micro_batch", mbs):
                continue
            accum = self.target.accumulation(mbs, base.dp)
            if accum is None:
                plan = _derive(base, micro_batch=mbs)
                got = mbs * base.dp * max(1, round(self.target.sequences / (mbs * base.dp)))
                self.reject(
                    plan,
                    "batch",
                    f"mbs {mbs} x DP {base.dp} reaches {got} sequences per step, more than "
                    f"{self.target.tolerance:.0%} from the target {self.target.sequences:g}",
                )
                continue
            if not self.allowed("grad_accum", accum):
                continue
            if base.pp > 1 and accum < base.pp and "grad_accum" not in self.fixed:
                plan = _derive(base, micro_batch=mbs, grad_accum=accum)
                self.reject(
                    plan,
                    "batch",
                    f"mbs {mbs} leaves {accum} micro-batches for {base.pp} pipeline stages: "
                    "every stage would idle more than half the step",
                )
                continue
            kinds = []
            for recompute in RECOMPUTE_POLICIES:
                if not self.allowed("recompute", recompute):
                    continue
                plan = _derive(base, micro_batch=mbs, grad_accum=accum, recompute=recompute)
                kinds.append(self.screen(plan))
                if kinds[-1] == "invalid":
                    break  # the same problem for every policy
            if kinds and all(kind == "memory" for kind in kinds):
                return  # a larger micro-batch needs more memory still

    def screen(self, plan: ParallelPlan) -> str:
        """Validity and the memory lower bound; a survivor joins the candidates with its bound."""
        problems = plan.problems(self.model, self.cluster)
        if problems:
            return self.reject(plan, "invalid", " ".join(problems)).kind
        bound = self.bounds.memory(plan, _inflight(plan))
        if bound > self.budget_bytes:
            return self.reject(
                plan, "memory", self.memory_reason(bound, None), bound - self.budget_bytes
            ).kind
        step = self.bounds.step(plan)
        tokens = plan.global_batch * self.model.seq_len
        factor = rank_factor(self.model, self.cluster, plan, self.risk)  # bounds the ranked key
        self.candidates.append(_Candidate(factor * tokens / step if step > 0 else math.inf, plan))
        return "candidate"

    def cost_candidates(self) -> None:
        """Full estimates, highest tokens/s bound first, until no bound can reach the top."""
        self.candidates.sort(key=lambda c: -c.upper_tokens_per_s)
        found: list[float] = []  # minus the tokens/s of fitting layouts, ascending
        for i, cand in enumerate(self.candidates):
            if len(found) >= self.top:
                threshold = min(-found[self.top - 1], -found[0] * (1 - TIE_FRACTION))
                if cand.upper_tokens_per_s < threshold:
                    self.pruned_by_bound = len(self.candidates) - i
                    self.considered += self.pruned_by_bound
                    return
            if self.lighter_recompute_fits(cand.plan):
                self.considered += 1
                continue  # same layout, less recompute, already fits: strictly faster
            outcome = self.estimate(cand.plan)
            if outcome.fits:
                bisect.insort(found, -rank_tokens_per_s(outcome.estimate, self.risk))

    def best_with(self, keep: Callable[[ParallelPlan], bool], budget: int = 60) -> Outcome | None:
        """The fastest fitting layout among those `keep` accepts: the same bounded search,
        restricted (at most `budget` more full estimates)."""
        best: Outcome | None = None
        for o in self.outcomes.values():
            if o.fits and keep(o.plan) and (best is None or _faster(o, best, self.risk)):
                best = o
        for cand in self.candidates:  # sorted by bound, best first
            if not keep(cand.plan):
                continue
            if best is not None and cand.upper_tokens_per_s <= rank_tokens_per_s(
                best.estimate, self.risk
            ):
                break
            if cand.plan in self.outcomes or self.lighter_recompute_fits(cand.plan):
                continue
            if budget == 0:
                break
            budget -= 1
            o = self.estimate(cand.plan)
            if o.fits and (best is None or _faster(o, best, self.risk)):
                best = o
        return best

    def nearest_rejection(self, keep: Callable[[ParallelPlan], bool]) -> Outcome | None:
        """The memory rejection with the smallest overflow among plans `keep` accepts."""
        misses = [o for o in self.outcomes.values() if o.kind == "memory" and keep(o.plan)]
        return min(misses, key=lambda o: o.overflow_bytes, default=None)

    def lighter_recompute_fits(self, plan: ParallelPlan) -> bool:
        order = RECOMPUTE_POLICIES.index(plan.recompute)
        for lighter in RECOMPUTE_POLICIES[:order]:
            o = self.outcomes.get(_derive(plan, recompute=lighter))
            if o is not None and o.fits:
                return True
        return False

    def reject(self, plan: ParallelPlan, kind: str, reason: str, overflow: float = 0.0) -> Outcome:
        outcome = Outcome(plan, None, reason, kind, overflow)
        self.outcomes[plan] = outcome
        self.considered += 1
        return outcome

    def evaluate(self, plan: ParallelPlan) -> Outcome:
        """The outcome of any plan (for the explanation): cached, else validity then estimate."""
        if plan in self.outcomes:
            return self.outcomes[plan]
        problems = plan.problems(self.model, self.cluster)
        if problems:
            return self.reject(plan, "invalid", " ".join(problems))
        return self.estimate(plan)

    def estimate(self, plan: ParallelPlan) -> Outcome:
        from fivefold.planner.estimate import estimate

        self.evaluated += 1
        try:
            est = estimate(self.model, self.cluster, plan, self.options)
        except ConfigError as err:
            return self.reject(plan, "invalid", str(err))
        worst = float(est.peak_memory_bytes)
        if not est.host_fits:
            host = est.host_memory
            return self.reject(plan, "memory", host_memory_reason(host), host.overflow_bytes)
        if worst > self.budget_bytes:
            reason = self.memory_reason(worst, int(est.worst_stage))
            outcome = self.reject(plan, "memory", reason, worst - self.budget_bytes)
            outcome.estimate = est
            return outcome
        outcome = Outcome(plan, est, "", "fits")
        self.outcomes[plan] = outcome
        self.considered += 1
        return outcome

    def memory_reason(self, need: float, stage: int | None) -> str:
        return memory_reason(need, stage, self.cluster.device.hbm_bytes, self.headroom)


def _derive(plan: ParallelPlan, **changes: Any) -> ParallelPlan:
    """`plan.with_(**changes)` without `dataclasses.replace`'s per-field work: the plan has no
    `__post_init__`, so copying its fields and setting the changed ones is the same plan."""
    new = object.__new__(ParallelPlan)
    new.__dict__.update(plan.__dict__)
    new.__dict__.update(changes)
    return new


def _faster(a: Outcome, b: Outcome, risk: str) -> bool:
    return rank_tokens_per_s(a.estimate, risk) > rank_tokens_per_s(b.estimate, risk)


def _inflight(plan: ParallelPlan) -> list[int]:
    """Peak in-flight micro-batches per pipeline rank for the plan's schedule."""
    if plan.pp == 1:
        return [1]
    return build_schedule(plan.schedule, plan.pp, plan.vpp, plan.grad_accum).peak_inflight


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
    explanation is `fivefold.planner.explain.explain(result)`.
    """
    with collector_paused():
        started = time.perf_counter()
        fixed = dict(fixed or {})
        opts = options or PlannerOptions.for_device(cluster.device)
        problems = _input_problems(model, cluster, headroom, top, precisions, fixed, risk)
        problems += opts.memory().problems()
        if problems:
            raise ConfigError(problems)
        require_hbm(cluster)
        target = batch_target(model, global_batch_tokens, global_batch, batch_tolerance)
        state = _Search(model, cluster, target, headroom, tuple(precisions), fixed, top, opts, risk)
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
) -> list[str]:
    """What is wrong with the search's inputs, and what the runtime refuses around the pins."""
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
        problems += pins.with_(precision="fp32").runtime_problems(model)
        problems += pins.device_problems(cluster)
        by_precision = [ParallelPlan(precision=p).runtime_problems() for p in precisions]
        if all(by_precision):
            problems += [p for found in by_precision for p in found]
    return problems


def _passes(state: _Search) -> SearchResult:
    """The first pass; when nothing fits, a second over the same layouts with the memory levers."""
    model, cluster, fixed = state.model, state.cluster, state.fixed
    state.run()
    _refuse_broken(state)
    ranked = rank_fitting([o for o in state.outcomes.values() if o.fits], state.risk)
    rejected = nearest_rejected(list(state.outcomes.values()))
    without_levers = None
    sets = lever_sets(model, cluster, fixed) if not ranked else ()
    if sets:
        without_levers = rejected[0] if rejected else None
        first = state
        state = _Search(
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


def _refuse_broken(state: _Search) -> None:
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


def lever_probe(fields: dict[str, Any]) -> ParallelPlan:
    """A plan of `fields` on the smallest layout their own rules allow (offload "all" needs
    ZeRO-3 over at least 2 ranks), so that only what the runtime refuses for every layout counts."""
    base: dict[str, Any] = {"zero": 3, "dp_shard": 2} if fields.get("offload") == "all" else {}
    return ParallelPlan(**{**base, **fields})


def lever_sets(
    model: ModelSpec, cluster: ClusterSpec, fixed: dict[str, Any]
) -> tuple[dict[str, str], ...]:
    """The memory levers the second pass tries (`AUTO_LEVERS`): those not fixed otherwise,
    that fivefold's runtime runs, and offload only where the catalog has the node's host."""
    from fivefold.planner.levers import offloads
    from fivefold.spec.hardware import host

    out = []
    for levers in AUTO_LEVERS:
        if any(k in fixed and fixed[k] != v for k, v in levers.items()):
            continue
        if all(k in fixed for k in levers):
            continue  # the first pass had it
        if lever_probe(levers).runtime_problems(model):
            continue
        if "offload" in levers and (
            host(cluster.gpu) is None or not offloads(ParallelPlan(**levers), cluster.device)
        ):
            continue
        out.append(levers)
    return tuple(out)
