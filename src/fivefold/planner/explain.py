"""The explanation of a search result: seed 000's decision staircase, in words with numbers.

The staircase (seed 000, "Vizz AI"), one step per line, each argued against its neighbours:
1. tensor parallelism inside a node: the chosen TP against the best layout with the next TP
   degree up and down (what their exposed collectives or memory cost);
2. the micro-batch: the largest that fits, or why a larger one loses;
3. pipeline stages: why this many and not fewer (memory) or more (the bubble), and what the
   bubble costs in seconds and per cent;
4. data parallelism is what remains, and the ZeRO stage: what each stage saves, why not less
   (memory) or more (gathers);
5. the batch target through gradient accumulation;
6. context parallelism for long sequences and expert parallelism for MoE models: when they are
   used, what they split, and what happens without them;
7. activation recomputation: why this policy;
8. the staircase taken literally (`staircase_plans`: TP fills the node, fewest stages that fit,
   ZeRO-1, full recompute, ...), costed against the searched layout;
then the nearest rejected layouts with their reason: "out of memory by X GiB" or "Y % slower
because ...". "The best layout with TP = 8" is found by the search's own bounded search
restricted to TP = 8 (`_Search.best_with`), so every comparison is between optimised layouts.
"""

from __future__ import annotations

from typing import Any

from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.hardware import GiB
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan

TIE_FRACTION = 0.005  # the search's tie band (fivefold.planner.search.TIE_FRACTION)
COMPARE_BUDGET = 8  # full estimates per "best layout with ..." comparison

BREAKDOWN_WORDS = {
    "compute_s": "compute",
    "in_stage_comm_s": "exposed in-stage communication (TP/CP/EP collectives, ZeRO-3 gathers)",
    "pipeline_bubble_s": "pipeline bubble",
    "dp_grad_exposed_s": "exposed data-parallel gradient reduction",
    "param_gather_exposed_s": "exposed parameter all-gather",
    "optimizer_s": "optimizer step",
    "runtime_sync_s": "the runtime's per-step token-count and loss all-reduces",
}


def explain_search(model: ModelSpec, cluster: ClusterSpec, result: Any) -> list[str]:
    """Lines of plain text explaining `result` (a `SearchResult`), staircase order."""
    return _Explainer(model, cluster, result).lines()


def seconds(x: float) -> str:
    """'1.23 s', '12.3 ms' or '45 us': enough digits for any model size."""
    if x == 0:
        return "0 s"
    if abs(x) >= 0.1:
        return f"{x:.2f} s"
    if abs(x) >= 1e-4:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def gib(x_bytes: float) -> str:
    """'12.55 GiB' or '3.2 MiB' for small models."""
    if abs(x_bytes) >= 0.01 * GiB or x_bytes == 0:
        return f"{x_bytes / GiB:.2f} GiB"
    return f"{x_bytes / 2**20:.1f} MiB"


def slower_because(est: Any, best: Any) -> str:
    """'12.3 % slower because its pipeline bubble is 2.1 s longer' (est against best)."""
    slower = 1 - est.tokens_per_s / best.tokens_per_s
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
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, result: Any):
        self.model = model
        self.cluster = cluster
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
            return f"{label}: {slower_because(est, self.best)} ({est.plan.describe()})"
        miss = self.nearest_oom(**fields)
        if miss is not None:
            reason = miss.reason.rstrip(".")
            return f"{label}: nothing fits; the closest, {miss.plan.describe()}, is {reason}"
        return f"{label}: no valid layout"

    def mem(self, est: Any) -> dict[str, float]:
        return est.worst_memory.gib()

    # ---- the staircase ---------------------------------------------------------------------
    def lines(self) -> list[str]:
        out = [
            self.tensor_parallel(),
            self.micro_batch(),
            self.pipeline(),
            self.data_parallel(),
            self.batch(),
            self.context_parallel(),
            self.expert_parallel(),
            self.recompute(),
            self.rule_of_thumb(),
            self.memory(),
        ]
        out += self.runners_up()
        return [line for line in out if line]

    def tensor_parallel(self) -> str:
        p, m, c = self.plan, self.model, self.cluster
        nv = c.intra_node_bw / 1e9
        ib = c.inter_node_bw / 1e9
        links = (
            f"NVLink {nv:.0f} GB/s against {ib:.0f} GB/s between nodes, {nv / ib:.0f}x faster; "
            "TP's collectives sit on the critical path of every layer"
        )
        if c.device.measured is not None:  # a calibrated machine: its own fitted links
            links = (
                "the collectives measured by `fivefold calibrate` on this machine; TP's sit on "
                "the critical path of every layer"
            )
        if p.tp > 1:
            text = (
                f"Tensor parallelism: TP = {p.tp} inside a node of {c.gpus_per_node} GPUs "
                f"({links}). "
            )
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
        choices = [t for t in _tp_values(m, c) if t != p.tp]
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
            text = (
                f"Pipeline: PP = {p.pp} stages ({_layers_text(est)} layers each) with "
                f"{p.schedule}"
                + (f" (v = {p.vpp} chunks per rank)" if p.vpp > 1 else "")
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
        shard = p.dp_shard * p.cp
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
                    f"The key/value exchange ({cp_comm[0].link}) takes "
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
        )
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
        policies = ("none", "selective", "full")
        words = []
        for policy in policies:
            if policy == p.recompute:
                continue
            o = self.search.evaluate(p.with_(recompute=policy))
            words.append(f"{policy}: " + self._outcome_words(o))
        return text + "; ".join(words) + "."

    def rule_of_thumb(self) -> str:
        """Seed 000's staircase applied literally, costed, against the searched layout."""
        outcome = None
        for plan in staircase_plans(self.model, self.cluster, self.result.target):
            outcome = self.search.evaluate(plan)
            if outcome.fits:
                break
        if outcome is None:
            return ""
        rule = (
            "The textbook rule of thumb taken literally (the decision staircase of the "
            "distributed-training guides: TP fills the node, the fewest pipeline "
            "stages that fit, DP the rest with ZeRO-1, micro-batch 1, full recompute, "
            "accumulation to the target, CP only if still needed)"
        )
        if outcome.plan == self.plan:
            return f"{rule} gives this very layout."
        if not outcome.fits:
            return f"{rule} finds nothing that fits; closest {outcome.plan.describe()}: " + (
                outcome.reason.rstrip(".") + "."
            )
        return (
            f"{rule} gives {outcome.plan.describe()}: "
            f"{slower_because(outcome.estimate, self.best)}."
        )

    def memory(self) -> str:
        est = self.best
        mem = self.mem(est)
        usable = est.hbm_bytes / GiB * (1 - self.result.headroom)
        return (
            f"Memory on the worst stage ({est.worst_stage}, {est.plan.precision}): params "
            f"{mem['params']:.2f} + grads {mem['grads']:.2f} + optimizer {mem['optimizer']:.2f} + "
            f"activations {mem['activations']:.2f} + other {mem['other']:.2f} = "
            f"{mem['total']:.1f} GiB of {est.hbm_bytes / GiB:.0f} GiB HBM ({usable:.1f} GiB "
            f"usable with {self.result.headroom:.0%} headroom). Step {seconds(est.step_time_s)}, "
            f"{est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}."
        )

    def runners_up(self) -> list[str]:
        out = []
        for alt in self.result.alternatives[:3]:
            out.append(f"Runner-up {alt.plan.describe()}: {slower_because(alt, self.best)}.")
        shapes = set()
        for plan, reason in self.result.rejected:
            shape = (plan.tp, plan.pp)
            if len(shapes) == 3:
                break
            if reason.startswith("out of memory") and shape not in shapes:
                out.append(f"Rejected {plan.describe()}: {reason}.")
                shapes.add(shape)
        return out

    def _outcome_words(self, outcome: Any, memory_too: bool = False) -> str:
        if outcome.fits:
            words = slower_because(outcome.estimate, self.best)
            if memory_too:
                delta = outcome.estimate.peak_memory_bytes - self.best.peak_memory_bytes
                words += f", {'+' if delta >= 0 else '-'}{gib(abs(delta))} per GPU"
            return words
        return (outcome.reason or outcome.kind).rstrip(".")


def staircase_plans(model: ModelSpec, cluster: ClusterSpec, target: Any) -> list[ParallelPlan]:
    """Seed 000's recipe, in the order it tries layouts: TP = the largest valid degree in a
    node, then PP = 1, 2, 4, ... with CP = 1, then the same with CP = 2, 4, 8 (ZeRO-1, mbs 1,
    full recompute, 1F1B, accumulation to the batch target)."""
    from fivefold.planner.search import divisors, tp_choices

    tp = max(tp_choices(model, cluster))
    world = cluster.world_size
    out = []
    for cp in (1, 2, 4, 8):
        if world % (tp * cp) or (cp > 1 and model.seq_len % (2 * cp)):
            continue
        for pp in divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            accum = target.accumulation(1, dp)
            if pp > model.layers or accum is None:
                continue
            zero = 1 if dp * cp > 1 else 0
            out.append(
                ParallelPlan(
                    tp=tp,
                    sp=tp > 1,
                    pp=pp,
                    cp=cp,
                    dp_shard=dp if zero else 1,
                    dp_replicate=1 if zero else dp,
                    zero=zero,
                    micro_batch=1,
                    grad_accum=accum,
                    recompute="full",
                )
            )
    return out


def _field(plan: ParallelPlan, name: str) -> Any:
    return plan.dp if name == "dp" else getattr(plan, name)


def _tp_values(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    from fivefold.planner.search import tp_choices

    return tp_choices(model, cluster)


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
