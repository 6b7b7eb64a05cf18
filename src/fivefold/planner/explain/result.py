"""The explanation of a search result: the rule-of-thumb staircase, in words with numbers.

One line per decision (TP, micro-batch, PP, DP and ZeRO, batch, CP, EP, recompute, memory
levers), each argued against the best layout the search finds under the other choice; then the
staircase taken literally (`staircase`), memory, confidence (`uncertainty`), published layouts
and runners-up. docs/planner.md, "The layout search", has the details.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fivefold.planner.budget import uncertainty
from fivefold.planner.estimate import estimate
from fivefold.planner.explain.levers import lever_words, levers_line
from fivefold.planner.explain.staircase import rule_of_thumb_line
from fivefold.planner.quantities import gib, seconds
from fivefold.planner.rates.coverage import device_model_line
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.efficiency import published_runs
from fivefold.planner.search.candidates import tp_choices
from fivefold.planner.search.layouts import collector_paused
from fivefold.planner.search.outcomes import TIE_FRACTION, SearchResult
from fivefold.planner.step_time.layer_costs import moe_tp_words
from fivefold.planner.step_time.muon import muon_line
from fivefold.specs.geometry import RECOMPUTE_POLICIES, dense_shard_degree
from fivefold.specs.plan import ParallelPlan
from fivefold.units import GiB

COMPARE_BUDGET = 8  # full estimates per "best layout with ..." comparison

BREAKDOWN_WORDS = {
    "compute_s": "compute",
    "in_stage_comm_s": "exposed in-stage communication (TP/CP/EP collectives, ZeRO-3 gathers)",
    "pipeline_bubble_s": "pipeline bubble",
    "dp_grad_exposed_s": "exposed data-parallel gradient reduction",
    "param_gather_exposed_s": "exposed parameter all-gather",
    "optimizer_s": "optimizer step",
    "offload_exposed_s": "exposed CPU-offload copies over PCIe",
    "runtime_sync_s": "the runtime's per-step token-count and loss all-reduces",
    "core_sharing_s": "time given back by ranks that wait while others use their cores "
    "(a CPU with fewer cores than ranks; negative)",
}


def explain(result: SearchResult) -> list[str]:
    """Lines of plain text explaining `result`, staircase order."""
    with collector_paused():  # the comparisons cost layouts as the search does
        return _Explainer(result).lines()


def slower_because(est: Any, best: Any, risk: str = "expected") -> str:
    """'12.3 % slower because its pipeline bubble is 2.1 s longer' (est against best); with
    risk "pessimistic", why a layout predicted faster ranks lower."""
    slower = 1 - est.tokens_per_s / best.tokens_per_s
    if risk != "expected" and slower < -TIE_FRACTION:
        ranked = 1 - uncertainty.rank_tokens_per_s(est, risk) / uncertainty.rank_tokens_per_s(
            best, risk
        )
        if ranked > 0:
            d = uncertainty.domain_distance(est.model, est.cluster, est.plan)
            return (
                f"{-slower:.1%} faster as predicted, but {d:.1f} doublings outside the "
                f"calibrated domain it is {ranked:.1%} slower at its band's slow end (risk = "
                f"{risk})"
            )
    diffs = {k: est.breakdown_s.get(k, 0.0) - best.breakdown_s.get(k, 0.0) for k in BREAKDOWN_WORDS}
    key = max(diffs, key=lambda k: diffs[k])
    if abs(slower) < 0.0005:
        return "the same speed"
    if slower < 0:
        delta = (est.peak_memory_bytes - best.peak_memory_bytes) / GiB
        return (
            f"{-slower:.1%} faster, within the {TIE_FRACTION:.1%} tie band (below the model's "
            f"error), but it needs {delta:+.1f} GiB per GPU and the planner keeps the headroom"
        )
    if diffs[key] <= 0:
        return f"{slower:.1%} slower"
    reason = f"its {BREAKDOWN_WORDS[key]} is {seconds(diffs[key])} longer per step"
    if key == "pipeline_bubble_s":
        reason += f" (bubble {est.bubble_fraction:.1%} against {best.bubble_fraction:.1%})"
    elif key == "compute_s" and est.plan.recompute != best.plan.recompute:
        reason += f" (recompute {est.plan.recompute} against {best.plan.recompute})"
    return f"{slower:.1%} slower because {reason}"


class _Explainer:
    def __init__(self, result: SearchResult):
        self.model = result.model
        self.cluster = result.cluster
        self.result = result
        self.search = result.search_state
        self.best = result.best
        self.plan: ParallelPlan = result.best_plan

    # ---- helpers -----------------------------------------------------------------------------
    def best_with(self, **fields: Any) -> Any:
        """The best fitting outcome whose plan has these field values (or None)."""

        def keep(p: ParallelPlan) -> bool:
            return all(_field(p, k) == v for k, v in fields.items())

        return self.search.best_with(keep, budget=COMPARE_BUDGET)

    def nearest_oom(self, **fields: Any) -> Any:
        return self.search.nearest_rejection(
            lambda p: all(_field(p, k) == v for k, v in fields.items())
        )

    def compare(self, label: str, **fields: Any) -> str:
        """What the best layout with `fields` is: slower (why), out of memory, or invalid."""
        other = self.best_with(**fields)
        if other is not None:
            est = other.estimate
            return f"{label}: {self.slower(est)} ({est.plan.describe()})"
        miss = self.nearest_oom(**fields)
        if miss is not None:
            reason = miss.reason.rstrip(".")
            return f"{label}: nothing fits; the closest, {miss.plan.describe()}, is {reason}"
        return f"{label}: no valid layout"

    def slower(self, est: Any) -> str:
        return slower_because(est, self.best, self.result.risk)

    # ---- the staircase ---------------------------------------------------------------------
    def lines(self) -> list[str]:
        m, c = self.model, self.cluster
        out = [
            self.tensor_parallel(),
            self.micro_batch(),
            self.pipeline(),
            self.data_parallel(),
            self.batch(),
            self.context_parallel(),
            self.expert_parallel(),
            self.recompute(),
            self.levers(),
            muon_line(self.best),
            self.rule_of_thumb(),
            memory_line(self.best, self.result.headroom),
            confidence_line(self.best, self.result.risk),
            *(published_line(run, self.best) for run in uncertainty.published_layouts(m, c)),
            *runners_up(self.result, self.slower),
        ]
        return [line for line in out if line]

    def tensor_parallel(self) -> str:
        p, m, c = self.plan, self.model, self.cluster
        nv = c.intra_node_bw / 1e9
        ib = c.inter_node_bw / 1e9
        links = (
            f"NVLink {nv:.0f} GB/s against {ib:.0f} GB/s between nodes, {nv / ib:.0f}x faster; "
            "TP's collectives sit on the critical path of every layer"
        )
        if rates_for(c.device).calibrated:  # a calibrated machine: its own fitted links
            links = (
                "the collectives measured by `fivefold calibrate` on this machine; TP's sit on "
                "the critical path of every layer"
            )
        if p.tp > 1:
            where = (
                f"a node of {c.gpus_per_node} GPUs"
                if c.nvlink_gpus == c.gpus_per_node
                else f"an NVLink domain of {c.nvlink_gpus} GPUs"
            )
            text = f"Tensor parallelism: TP = {p.tp} inside {where} ({links}). "
        else:
            text = (
                f"Tensor parallelism: none (TP = 1). TP would stay inside a node of "
                f"{c.gpus_per_node} GPUs ({links}), but the model fits without it, so TP would "
                "only add communication. "
            )
        if p.tp > 1:
            text += (
                f"Each GPU holds 1/{p.tp} of every weight matrix and {m.heads // p.tp} of the "
                f"{m.heads} attention heads"
                + (
                    ", with sequence parallelism for norms and the residual stream. "
                    if p.sp
                    else ". "
                )
            )
        tp_comm = [x for x in self.best.comm if x.kind == "tp"]
        if tp_comm:
            text += f"Its exposed collectives cost {seconds(tp_comm[0].exposed_s)} per step. "
        choices = [t for t in tp_choices(m, c) if t != p.tp]
        around = [t for t in choices if t in (p.tp // 2, p.tp * 2, max(choices))] or choices[:2]
        text += "; ".join(self.compare(f"TP = {t}", tp=t) for t in around)
        return text.rstrip("; ") + "."

    def micro_batch(self) -> str:
        p, target = self.plan, self.result.target
        text = (
            f"Micro-batch: {p.micro_batch} sequence(s) of {self.model.seq_len:,} tokens "
            f"({p.micro_batch * self.model.seq_len // p.cp:,} tokens per GPU"
            + (f" after CP {p.cp}" if p.cp > 1 else "")
            + "); activations grow with it while weights do not. "
        )
        bigger = p.micro_batch * 2
        if bigger * p.dp > target.sequences * (1 + target.tolerance):
            return text + (
                f"mbs {bigger} x DP {p.dp} = {bigger * p.dp} sequences would overshoot the "
                f"target of {target.sequences:g} per step."
            )
        return text + self.compare(f"mbs {bigger}", micro_batch=bigger) + "."

    def pipeline(self) -> str:
        p, est = self.plan, self.best
        if p.pp == 1:
            text = (
                f"Pipeline: none (PP = 1): all {self.model.layers} layers fit on each GPU, so "
                "there is no bubble. "
            )
        else:
            bubble_s = est.breakdown_s.get("pipeline_bubble_s", 0.0)
            split = f"({_layers_text(est)} layers each)"
            if p.vpp > 1:
                split = f"in {p.pp * p.vpp} chunks {split}, {p.vpp} per rank,"
            text = (
                f"Pipeline: PP = {p.pp} stages {split} with {p.schedule}"
                + f" over {p.grad_accum} micro-batches: the bubble is "
                f"{est.bubble_fraction:.1%} of the pipeline time ({seconds(bubble_s)} per step; "
                f"1F1B's (p-1)/(m+p-1) = {(p.pp - 1) / (p.grad_accum + p.pp - 1):.1%}). "
            )
        parts = []
        if p.pp > 1:
            parts.append(self.compare(f"fewer stages (PP = {p.pp // 2})", pp=p.pp // 2))
        more = p.pp * 2
        if more <= self.model.layers and self.cluster.world_size % (more * p.tp * p.cp) == 0:
            parts.append(self.compare(f"more stages (PP = {more})", pp=more))
        return text + "; ".join(parts) + ("." if parts else "")

    def data_parallel(self) -> str:
        p, est = self.plan, self.best
        text = (
            f"Data parallelism is what remains: DP = {self.cluster.world_size} / (TP {p.tp} x "
            f"PP {p.pp} x CP {p.cp}) = {p.dp}"
            + (
                f" (HSDP: {p.dp_replicate} replicas of {p.dp_shard}-way shards)"
                if p.dp_replicate > 1 and p.dp_shard > 1
                else ""
            )
            + ". "
        )
        shard = dense_shard_degree(p)
        mm = est.worst_memory
        text += (
            f"ZeRO-{p.zero} shards "
            + {
                0: "nothing",
                1: "the optimizer state",
                2: "optimizer state and gradients",
                3: "optimizer state, gradients and parameters",
            }[p.zero]
            + (f" over {shard} ranks (DP x CP)" if p.zero else "")
            + f": per GPU params {gib(mm.params)}, grads {gib(mm.grads)}, optimizer "
            f"{gib(mm.optimizer)}. "
        )
        others = []
        for zero in (0, 1, 2, 3):
            if zero == p.zero or (zero == 0 and shard == 1):
                continue
            variant = _with_zero(p, zero)
            if variant is None:
                continue
            o = self.search.evaluate(variant)
            others.append(f"ZeRO-{zero}: " + self._outcome_words(o, memory_too=True))
        return text + "; ".join(others) + ("." if others else "")

    def batch(self) -> str:
        p, target = self.plan, self.result.target
        got = p.global_batch
        tokens = got * self.model.seq_len
        return (
            f"Batch: mbs {p.micro_batch} x DP {p.dp} x {p.grad_accum} accumulation steps = "
            f"{got} sequences = {tokens:,} tokens per optimizer step (target "
            f"{target.tokens:,.0f}, {abs(got / target.sequences - 1):.1%} off; tolerance "
            f"{target.tolerance:.0%}). Gradient accumulation reaches the target without more "
            "GPUs or a larger micro-batch."
        )

    def context_parallel(self) -> str:
        p, m = self.plan, self.model
        s = m.seq_len
        if p.cp > 1:
            local = s // p.cp
            text = (
                f"Context parallelism: CP = {p.cp} ({p.cp_kind} attention) splits each "
                f"{s:,}-token sequence into {p.cp} chunks of {local:,}; every GPU computes "
                f"{local:,} x {s:,} query-key blocks instead of {s:,} x {s:,} and keeps "
                f"1/{p.cp} of the activations. "
            )
            cp_comm = [x for x in self.best.comm if x.kind == "cp"]
            if cp_comm:
                text += (
                    f"The key/value exchange ({cp_comm[0].link_model or cp_comm[0].link}) takes "
                    f"{seconds(cp_comm[0].time_s)} per step, {seconds(cp_comm[0].exposed_s)} of "
                    "it not hidden behind attention. "
                )
            return text + self.compare("without CP", cp=1) + "."
        if s >= 32_768:
            return (
                f"Context parallelism: not used at {s:,} tokens; "
                + self.compare("the best layout with CP = 2", cp=2)
                + "."
            )
        return (
            f"Context parallelism: not needed at {s:,} tokens per sequence (activations of one "
            f"sequence are {self.best.worst_memory.activations / GiB:.1f} GiB per GPU here)."
        )

    def expert_parallel(self) -> str:
        p, m = self.plan, self.model
        if not m.is_moe:
            return (
                f"Expert parallelism: not needed, {m.name} is a dense model (every token uses "
                "every weight); a MoE variant would place its experts on EP ranks across nodes."
            )
        text = (
            f"Expert parallelism: EP = {p.ep} puts {m.experts // p.ep} of the {m.experts} "
            f"experts on each rank (top-{m.top_k} routing, all-to-all dispatch and combine). "
        ) + (moe_tp_words(m, p) if p.tp > p.etp else "")
        ep_comm = [x for x in self.best.comm if x.kind == "ep"]
        if ep_comm:
            text += f"Its all-to-alls cost {seconds(ep_comm[0].exposed_s)} per step. "
        if p.ep > 1:
            text += self.compare("EP = 1", ep=1) + "."
        else:
            wider = next((e for e in range(2, m.experts + 1) if m.experts % e == 0), None)
            if wider is not None:
                text += self.compare(f"EP = {wider}", ep=wider) + "."
        return text

    def recompute(self) -> str:
        p, est = self.plan, self.best
        acts = est.worst_memory.activations / GiB
        text = (
            f"Activation recompute: {p.recompute} (activations {acts:.1f} GiB on the worst stage). "
        )
        words = []
        for policy in RECOMPUTE_POLICIES:
            if policy == p.recompute:
                continue
            o = self.search.evaluate(p.with_(recompute=policy))
            words.append(f"{policy}: " + self._outcome_words(o))
        return text + "; ".join(words) + "."

    def levers(self) -> str:
        return levers_line(self.result, self.compare)

    def rule_of_thumb(self) -> str:
        """The staircase applied literally, costed, against the searched layout."""
        return rule_of_thumb_line(self.search, self.result.target, self.plan, self.slower)

    def _outcome_words(self, outcome: Any, memory_too: bool = False) -> str:
        if outcome.fits:
            words = self.slower(outcome.estimate)
            if memory_too:
                delta = outcome.estimate.peak_memory_bytes - self.best.peak_memory_bytes
                words += f", {'+' if delta >= 0 else '-'}{gib(abs(delta))} per GPU"
            return words
        return (outcome.reason or outcome.kind).rstrip(".")


def memory_line(est: Any, headroom: float) -> str:
    """The worst stage's memory by tenant against HBM, and the step's speed."""
    mem = est.worst_memory.gib()
    usable = est.hbm_bytes / GiB * (1 - headroom)
    levers = "".join(f", {w}" for w in lever_words(est.plan))
    return (
        f"Memory on the worst stage ({est.worst_stage}, {est.plan.precision}{levers}): params "
        f"{mem['params']:.2f} + grads {mem['grads']:.2f} + optimizer {mem['optimizer']:.2f} + "
        f"activations {mem['activations']:.2f} + other {mem['other']:.2f} = "
        f"{mem['total']:.1f} GiB of {est.hbm_bytes / GiB:.0f} GiB HBM ({usable:.1f} GiB "
        f"usable with {headroom:.0%} headroom). Step {seconds(est.step_time_s)}, "
        f"{est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}."
    )


def runners_up(result: SearchResult, slower: Callable[[Any], str]) -> list[str]:
    """The next three layouts, and out-of-memory rejections of three other (TP, PP) shapes."""
    out = []
    for alt in result.alternatives[:3]:
        out.append(f"Runner-up {alt.plan.describe()}: {slower(alt)}.")
    shapes = set()
    for plan, reason in result.rejected:
        shape = (plan.tp, plan.pp)
        if len(shapes) == 3:
            break
        if reason.startswith("out of memory") and shape not in shapes:
            out.append(f"Rejected {plan.describe()}: {reason}.")
            shapes.add(shape)
    return out


def price(est: Any) -> str:
    """'step 5.23 s, MFU 49.0 % (band 39.3-68.0 %)' (no band on a measured device)."""
    b = uncertainty.band(est)
    text = f"step {seconds(est.step_time_s)}, MFU {est.mfu:.1%}"
    if b is None:
        return text
    lo, hi = b.mfu_range(est.mfu)
    return text + f" (band {lo:.1%}-{hi:.1%})"


def confidence_line(est: Any, risk: str | None = None) -> str:
    """The prediction's band, the calibrated domain and the closest published run; with a
    search's `risk`, what the search ranked by. On a measured device, where the published
    runs' errors say nothing, where its own errors are recorded instead."""
    b = uncertainty.band(est)
    if b is None:
        return (
            f"Confidence: predicted {price(est)} on {est.cluster.device.name}, a device measured "
            "by `fivefold calibrate`. The published GPU runs' errors do not apply to it: the "
            "step-time model of fivefold's own runtime on such a machine is checked by "
            "`benchmarks/plan_vs_run.py` (docs/planner.md, 'Plan vs run on CPU': on an idle "
            "2-core machine within 16 % of the measured step on every one of its 24 layouts, "
            "7.5 % on average); layouts are ranked by the prediction. " + device_model_line(est)
        )
    r_lo, r_hi = uncertainty.residual_range()
    sources = uncertainty.held_out_residuals()
    rows = sum(len(v) for v in sources.values())
    text = (
        f"Confidence: predicted {price(est)}. The planner's errors on {rows} published rows "
        f"it was not fitted to ({len(sources)} sources, {uncertainty.RESIDUAL_KIND}) run from "
        f"{r_lo:+.1%} to {r_hi:+.1%} of the step time, so the measured step should lie in "
        f"{seconds(b.low_s)}-{seconds(b.high_s)}. "
    )
    words = uncertainty.calibrated_domain().describe(
        uncertainty.layout_point(est.model, est.plan), est.cluster.device.arch
    )
    if words:
        text += (
            f"OUTSIDE the calibrated domain by {b.distance:.1f} doublings ({'; '.join(words)}): "
            f"the band is widened by {uncertainty.WIDENING_PER_DOUBLING:.0%} per doubling, so "
            "treat the figure as a model's extrapolation. "
        )
    else:
        text += "Inside the calibrated domain (every degree, tokens per GPU, size and GPU type "
        text += "within the published rows' ranges). "
    if risk is not None:
        ranked = "the slow end of the band" if risk == "pessimistic" else "the prediction"
        text += f"Ranked by {ranked} (risk = {risk}). "
    setup, dist = uncertainty.nearest_run(est.model, est.cluster, est.plan)
    return text + f"Closest published run: {run_words(setup)} (distance {dist:.1f})."


def run_words(setup: Any) -> str:
    """'row 32 (Llama 3 paper Table 4 ...): llama3-405b on 16,384 x h100-sxm, TP8+SP, PP16 ...'"""
    return (
        f"row {setup.row} ({_source(setup)}): {setup.model.name} on "
        f"{setup.cluster.world_size:,} x {setup.cluster.gpu}, {setup.plan.describe()}"
    )


def published_line(setup: Any, chosen: Any) -> str:
    """The published layout of this model and cluster, predicted and measured, beside `chosen`."""
    est = estimate(setup.model, setup.cluster, setup.plan, setup.options, runtime=False)
    measured_mfu = est.mfu * est.step_time_s / setup.measured_step_s
    ratio = chosen.tokens_per_s / est.tokens_per_s - 1
    return (
        f"Published layout, {run_words(setup)}: predicted {price(est)}; measured step "
        f"{seconds(setup.measured_step_s)}, MFU {measured_mfu:.1%} (our FLOP count). The chosen "
        f"layout: {price(chosen)}, predicted {ratio:+.1%} tokens/s against the published one."
    )


def _source(setup: Any) -> str:
    source = getattr(setup, "source", None)
    if source:
        return str(source)
    row = next(r for r in published_runs() if str(r["id"]) == str(setup.row))
    return uncertainty.source_key(row)


def _field(plan: ParallelPlan, name: str) -> Any:
    return plan.dp if name == "dp" else getattr(plan, name)


def _with_zero(plan: ParallelPlan, zero: int) -> ParallelPlan | None:
    dp = plan.dp
    if zero == 0:
        return plan.with_(zero=0, dp_replicate=dp, dp_shard=1)
    return plan.with_(zero=zero, dp_replicate=1, dp_shard=dp)


def _layers_text(est: Any) -> str:
    """'16' when every chunk has as many layers, else '2 (1 in the first and last)'-style."""
    counts = list(est.layer_counts)
    if len(set(counts)) == 1:
        return str(counts[0])
    if len(counts) <= 4:
        return "/".join(str(c) for c in counts)
    common = max(set(counts), key=counts.count)
    odd = [f"{c} in chunk {i}" for i, c in enumerate(counts) if c != common]
    if len(odd) > 3:
        return f"{min(counts)}-{max(counts)}"
    return f"{common} ({', '.join(odd)})"
