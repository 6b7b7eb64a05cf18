"""The state of one layout search (`SearchState`): it walks the choices of `candidates`, screens
each by validity, batch and a memory lower bound (`bounds`), then costs the survivors best
bound first with `estimate`; the explanation asks it further questions. The rules are in
docs/planner.md, "The layout search".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fivefold.errors import ConfigError
from fivefold.planner.budget.uncertainty import DEFAULT_RISK, rank_factor, rank_tokens_per_s
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.planner.schedule.actions import build_schedule
from fivefold.planner.search.bounds import Bounds
from fivefold.planner.search.candidates import (
    LEVER_FIELDS,
    cp_choices,
    divisors,
    dp_splits,
    ep_choices,
    micro_batch_choices,
    schedule_choices,
    tp_choices,
)
from fivefold.planner.search.outcomes import (
    TIE_FRACTION,
    BatchTarget,
    Outcome,
    host_memory_reason,
    memory_reason,
)
from fivefold.specs.batch import nearest_grad_accum
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import RECOMPUTE_POLICIES
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan


@dataclass
class _Candidate:
    """A screened layout and the most tokens/s it can reach (its bound, risk-weighted)."""

    upper_tokens_per_s: float
    plan: ParallelPlan


@dataclass
class SearchState:
    """One search's inputs, every outcome so far (by plan) and the screened candidates."""

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
    def runtime_rules(self) -> bool:
        """Whether fivefold's runtime rules bind the layouts: the options describe that runtime
        (`PlannerOptions.fivefold_runtime`), not other software."""
        return self.options.fivefold_runtime

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
        problems = shape.problems(self.model, self.cluster, runtime=self.runtime_rules)
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
        lists = [
            o.plan.problems(self.model, self.cluster, runtime=self.runtime_rules) for o in outcomes
        ]
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
            for ep in ep_choices(self.model, dp_shard, cp, tp):
                if not self.allowed("ep", ep):
                    continue
                for schedule, vpp in schedule_choices(self.model, pp, self.fixed.get("schedule")):
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
                got = mbs * base.dp * nearest_grad_accum(self.target.sequences, mbs, base.dp)
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
        problems = plan.problems(self.model, self.cluster, runtime=self.runtime_rules)
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
        problems = plan.problems(self.model, self.cluster, runtime=self.runtime_rules)
        if problems:
            return self.reject(plan, "invalid", " ".join(problems))
        return self.estimate(plan)

    def estimate(self, plan: ParallelPlan) -> Outcome:
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
