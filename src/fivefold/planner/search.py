"""The layout search: every valid way to run a model on a cluster, ranked by predicted tokens/s.

What is enumerated (outer to inner, so memory can prune whole subtrees early):
- tp: divisors of the GPUs per node (TP stays on NVLink) that the heads, key/value heads and MLP
  widths allow;
- cp: divisors of the rest with at least `MIN_CP_TOKENS` tokens per rank (below that, ring
  attention is latency-bound and never pays);
- pp: divisors of the rest, at most the number of layers; dp is what remains;
- the data-parallel split and ZeRO stage: ZeRO 1/2/3 over all DP ranks and HSDP (ZeRO-3 sharded
  inside groups of dp_shard, replicated across them). Plain DP (zero 0) only when pinned or when
  there is nothing to shard: ZeRO-1 moves the same bytes (reduce-scatter + all-gather = one
  all-reduce) and saves the optimizer state;
- ep (MoE models): divisors of the experts that divide dp_shard * cp;
- the schedule: one stage per rank (1f1b) without a pipeline; with one, gpipe, 1f1b,
  interleaved-1f1b with v in `VPP_CHOICES`, zbv, and dualpipev for MoE models (for a dense model
  it only adds a chunk of activations to ZBV);
- precision (the recipes asked for; bf16-mixed by default: changing numerics is a modelling
  decision, not a layout one);
- micro-batch (powers of two) and recompute (none, selective, full);
- grad_accum follows from the batch target: round(G / (mbs * dp)), G in sequences. The layout is
  kept when mbs * dp * accum is within `batch_tolerance` (default 5 %) of G.

Every candidate is checked by `ParallelPlan.problems(model, cluster)` (the source of truth for
validity) before it is costed. A pinned degree is tried even where the enumeration would skip it,
so when every layout breaks a rule (tp = 5 and 32 heads) the search says which, in validation's
words, instead of blaming memory. Pruning, cheapest first:
1. batch: dp ranks x one sequence already over the target -> the whole (tp, cp, pp) shape goes;
2. memory lower bound: pipeline rank 0 alone (it holds the embedding and, in every schedule here,
   the most micro-batches in flight) must fit; a miss is a rejection without the full estimate;
3. recompute dominance: for a fixed layout and micro-batch, the first policy of none ->
   selective -> full that fits is kept; heavier ones only add compute;
4. micro-batch monotonicity: if a micro-batch does not fit even with full recompute, larger
   ones do not either.
Memory levers (CPU offload, 8-bit Adam states: `AUTO_LEVERS`) are tried only when nothing fits
without them, in a second pass over the same layouts (`lever_sets`); FP8 compute only when pinned.
What fits in (1 - headroom) x HBM (and, with offload, in the node's host RAM) is costed by
`fivefold.planner.estimate.estimate` and ranked by
tokens/s at the slow end of its error band (`risk="pessimistic"`, the default: the model's errors
grow outside the calibrated domain, so a layout far from every published run must be clearly
faster to win; `fivefold.planner.uncertainty`) or by the predicted tokens/s (`risk="expected"`).
Layouts within `TIE_FRACTION` of the fastest count as a tie, broken by the smaller worst-stage
memory (a practitioner keeps the headroom). Rejections keep their reason;
the nearest ones (smallest memory overflow first) are returned with the result.
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
from fivefold.planner.schedule import build_schedule
from fivefold.planner.uncertainty import (
    DEFAULT_RISK,
    rank_factor,
    rank_tokens_per_s,
    risk_problems,
)
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.geometry import ep_fits
from fivefold.spec.hardware import GiB
from fivefold.spec.model import RECOMPUTE_POLICIES, ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import RECIPES

DEFAULT_BATCH_TOKENS = 4 * 2**20  # ~4M tokens: the seeds' target and Llama-scale practice
BATCH_TOLERANCE = 0.05
MIN_CP_TOKENS = 1024
VPP_CHOICES = (2, 4, 8)
MAX_MICRO_BATCH = 64
TIE_FRACTION = 0.005
KEEP_REJECTED = 40
# Memory levers (issue 11), tried only when no layout fits without them, cheapest first in
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


@dataclass
class SearchResult:
    """The fastest layout, the runners-up, the nearest rejections and why."""

    best: Any  # Estimate
    best_plan: ParallelPlan
    alternatives: list[Any]  # Estimates, fastest first (best excluded)
    rejected: list[tuple[ParallelPlan, str]]
    explanation: list[str]
    evaluated: int  # full estimates computed
    considered: int = 0  # candidates looked at (including pruned ones)
    elapsed_s: float = 0.0
    target: BatchTarget | None = None
    headroom: float = 0.10
    outcomes: dict[ParallelPlan, Outcome] = field(default_factory=dict, repr=False)
    search_state: Any = field(default=None, repr=False)  # the _Search, for the explanation
    pruned_by_bound: int = 0
    options: PlannerOptions = field(default_factory=PlannerOptions)
    risk: str = DEFAULT_RISK
    # When only the memory levers made a layout fit: the closest layout without them.
    without_levers: Outcome | None = None


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
        per_step = micro_batch * dp
        accum = max(1, round(self.sequences / per_step))
        return accum if self.within(per_step * accum) else None

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
        worst = worst_stage_bytes(est)
        if not est.host_fits:
            host = est.host_memory
            return self.reject(
                plan,
                "memory",
                f"out of host memory by {_amount(host.overflow_bytes)}: offloading puts "
                f"{host.per_node_bytes / GiB:,.0f} GiB on each node of "
                f"{host.usable_bytes / GiB:,.0f} GiB usable ({host.system}, "
                f"{host.node_ram_bytes / GiB:,.0f} GiB less the reserve for the system)",
                host.overflow_bytes,
            )
        if worst > self.budget_bytes:
            outcome = self.reject(
                plan,
                "memory",
                self.memory_reason(worst, worst_stage(est)),
                worst - self.budget_bytes,
            )
            outcome.estimate = est
            return outcome
        outcome = Outcome(plan, est, "", "fits")
        self.outcomes[plan] = outcome
        self.considered += 1
        return outcome

    def memory_reason(self, need: float, stage: int | None) -> str:
        hbm = self.cluster.device.hbm_bytes
        where = f"pipeline stage {stage} needs" if stage is not None else "needs at least"
        return (
            f"out of memory by {'at least ' if stage is None else ''}"
            f"{_amount(need - self.budget_bytes)}: {where} {need / GiB:.1f} GiB of "
            f"{self.budget_bytes / GiB:.1f} GiB usable ({hbm / GiB:.0f} GiB HBM less "
            f"{self.headroom:.0%} headroom)"
        )


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


# ---- reading an Estimate -------------------------------------------------------------------
def tokens_per_s(est: Any) -> float:
    return float(est.tokens_per_s)


def worst_stage_bytes(est: Any) -> float:
    """Total bytes of the worst pipeline stage of an estimate."""
    return float(est.peak_memory_bytes)


def worst_stage(est: Any) -> int:
    return int(est.worst_stage)


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
    winner = min(tied, key=lambda o: (worst_stage_bytes(o.estimate), -key[id(o)]))
    return [winner] + [o for o in fits if o is not winner]


def nearest_rejected(outcomes: list[Outcome], keep: int = KEEP_REJECTED) -> list[Outcome]:
    """Memory rejections by smallest overflow, then batch misses, then invalid layouts."""
    order = {"memory": 0, "batch": 1, "invalid": 2}
    rejected = [o for o in outcomes if not o.fits]
    rejected.sort(key=lambda o: (order.get(o.kind, 3), o.overflow_bytes))
    return rejected[:keep]


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    global_batch_tokens: int | None = None,
    global_batch: int | None = None,
    headroom: float = 0.10,
    top: int = 5,
    batch_tolerance: float = BATCH_TOLERANCE,
    precisions: tuple[str, ...] | list[str] = ("bf16-mixed",),
    fixed: dict[str, Any] | None = None,
    explain: bool = True,
    options: PlannerOptions | None = None,
    risk: str = DEFAULT_RISK,
) -> SearchResult:
    """Search every valid layout of `model` on `cluster`; see the module docstring.

    `fixed` pins plan fields (e.g. {"tp": 8}); `precisions` lists the recipes to consider;
    `options` are the software assumptions every candidate is costed with (default
    `PlannerOptions.for_device(cluster.device)`, as `estimate` uses); `risk` is "pessimistic"
    (rank by the slow end of each layout's error band, the default) or "expected". Raises
    `ConfigError` when the inputs are wrong or no layout fits, with what came closest.
    """
    with _collector_paused():
        return _search(
            model,
            cluster,
            global_batch_tokens=global_batch_tokens,
            global_batch=global_batch,
            headroom=headroom,
            top=top,
            batch_tolerance=batch_tolerance,
            precisions=precisions,
            fixed=fixed,
            explain=explain,
            options=options,
            risk=risk,
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
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


def _search(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    global_batch_tokens: int | None,
    global_batch: int | None,
    headroom: float,
    top: int,
    batch_tolerance: float,
    precisions: tuple[str, ...] | list[str],
    fixed: dict[str, Any] | None,
    explain: bool,
    options: PlannerOptions | None,
    risk: str,
) -> SearchResult:
    started = time.perf_counter()
    problems = model.problems() + cluster.problems()
    if not 0 <= headroom < 1:
        problems.append(f"headroom = {headroom}: must be in [0, 1), e.g. 0.1 for 10 %.")
    if top < 1:
        problems.append(f"top = {top}: must be at least 1.")
    problems += risk_problems(risk)
    for p in precisions:
        if p not in RECIPES:
            problems.append(f"precision {p!r} is unknown; choose from {', '.join(RECIPES)}.")
    for name in fixed or {}:
        if name not in FIXABLE:
            problems.append(
                f"fixed plan field {name!r} is not a plan setting; known: {', '.join(FIXABLE)}."
            )
    if not problems:  # what the runtime refuses whatever the search picks around the pins
        pins = lever_probe({k: v for k, v in (fixed or {}).items() if k in PLAN_FIELDS})
        problems += pins.with_(precision="fp32").runtime_problems(model)
        problems += pins.device_problems(cluster)
        by_precision = [ParallelPlan(precision=p).runtime_problems() for p in precisions]
        if all(by_precision):
            problems += [p for found in by_precision for p in found]
    opts = options or PlannerOptions.for_device(cluster.device)
    problems += opts.memory().problems()
    if problems:
        raise ConfigError(problems)
    if cluster.device.hbm_bytes <= 0:
        raise ConfigError(
            f"cluster.gpu = {cluster.gpu!r} has no HBM capacity in the catalog, so nothing can be "
            "planned for it; pick a GPU type such as h100-sxm."
        )
    target = batch_target(model, global_batch_tokens, global_batch, batch_tolerance)
    state = _Search(
        model, cluster, target, headroom, tuple(precisions), dict(fixed or {}), top, opts, risk
    )
    state.run()
    outcomes = list(state.outcomes.values())
    broken = state.broken_rules()
    if broken:  # every layout breaks a rule (a pinned degree): no memory lever can help
        pinned = ", ".join(f"{k} {v}" for k, v in (fixed or {}).items())
        where = f"{model.name} on {cluster.world_size} x {cluster.gpu}"
        head = (
            f"no layout of {where} with the pinned fields ({pinned}) can run: every one "
            "breaks a rule; change a pinned value."
            if pinned
            else f"no layout of {where} can run: every one breaks a rule."
        )
        raise ConfigError([head, *broken])
    ranked = rank_fitting([o for o in outcomes if o.fits], risk)
    rejected = nearest_rejected(outcomes)
    without_levers = None
    sets = lever_sets(model, cluster, dict(fixed or {})) if not ranked else ()
    if sets:  # nothing fits: a second pass over the same layouts with the memory levers
        without_levers = rejected[0] if rejected else None
        state = _Search(
            model,
            cluster,
            target,
            headroom,
            tuple(precisions),
            dict(fixed or {}),
            top=top,
            options=opts,
            risk=risk,
            lever_sets=sets,
        )
        state.run()
        outcomes = list(state.outcomes.values())
        ranked = rank_fitting([o for o in outcomes if o.fits], risk)
        rejected = nearest_rejected(outcomes) if ranked else rejected
    if not ranked:
        message = no_layout_message(model, cluster, target, headroom, rejected)
        if sets:
            tried = "; ".join(", ".join(f"{k} {v}" for k, v in lv.items()) for lv in sets)
            message += f" The memory levers did not make any layout fit either ({tried})."
        raise ConfigError(message)
    result = SearchResult(
        best=ranked[0].estimate,
        best_plan=ranked[0].plan,
        alternatives=[o.estimate for o in ranked[1:top]],
        rejected=[(o.plan, o.reason) for o in rejected],
        explanation=[],
        evaluated=state.evaluated,
        considered=state.considered,
        target=target,
        headroom=headroom,
        outcomes=state.outcomes,
        search_state=state,
        pruned_by_bound=state.pruned_by_bound,
        options=opts,
        risk=risk,
        without_levers=without_levers,
    )
    if explain:
        from fivefold.planner.explain import explain_search

        result.explanation = explain_search(model, cluster, result)
    result.elapsed_s = time.perf_counter() - started
    return result


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


def iter_fitting(result: SearchResult) -> Iterator[Outcome]:
    """Every fitting outcome of a search, fastest first."""
    yield from rank_fitting([o for o in result.outcomes.values() if o.fits], result.risk)


def _amount(num_bytes: float) -> str:
    """Bytes in GiB with one decimal, or in MiB below 0.1 GiB (never "0.0 GiB")."""
    if num_bytes >= 0.1 * GiB:
        return f"{num_bytes / GiB:.1f} GiB"
    return f"{max(num_bytes / 2**20, 0.1):.1f} MiB"
