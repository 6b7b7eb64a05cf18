"""Device rates: how fast one rank computes, streams memory and communicates on its device.

`DeviceRates` is everything the cost model asks of a device; `rates_for(device, eff)` gives
one of its two implementations:

- `CatalogRates`: a catalogued GPU's datasheet figures times the efficiency model
  (`fivefold.planner.rates.efficiency`): GEMMs under a smooth roofline, the attention core at a
  fraction of the bf16 peak, streaming at a fraction of HBM bandwidth, a fixed overhead per
  layer, fused kernels (QKV as one matmul); collectives priced by where the group sits on the
  cluster's links (`fivefold.planner.step_time.comm.Link`).
- `MeasuredRates`: a device profile measured by `fivefold calibrate` (`fivefold.specs.profile`)
  as one rank reads it: each matmul pass on its own shape and operand layout, interpolated in
  log space (`log_shape_interp`); attention, bandwidths and per-layer overheads as measured;
  collectives between their measured sizes, else from their fitted alpha and beta
  (`FittedLink`).

Times in seconds, rates in FLOP/s and bytes/s; shapes (m, n, k) are (m x k) @ (k x n).
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fivefold.errors import ConfigError
from fivefold.planner.memory.levers import node_host, offloads
from fivefold.planner.rates.collective_samples import nearest_group, sampled_time_s
from fivefold.planner.rates.efficiency import EfficiencyModel, efficiency_model
from fivefold.planner.rates.shape_interp import log_shape_interp
from fivefold.planner.step_time.layer_matmuls import eager_matmuls, expert_projections, layer_gemms
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe
from fivefold.specs.profile import Attention, Collective, GroupedMatmul, RankProfile, bus_factor

ATTENTION_DTYPE = "bf16"  # attention kernels run in bf16 even under fp8 recipes
Options = TypeVar("Options")
Passes = tuple[float, float, float]  # (forward, input gradient, weight gradient) seconds


class DeviceRates(ABC):
    """What one rank of a device does per second (module doc)."""

    calibrated: bool = False  # this machine's own measurements, not catalog figures

    @abstractmethod
    def gemm_flops_per_s(self, m: float, n: float, k: float, dtype: str, layout: str) -> float:
        """FLOP/s of one (m x k) @ (k x n) matmul; `layout` "nt" (forward x W^T), "nn" (input
        gradient g W) or "tn" (weight gradient g^T x)."""

    def gemm_s(
        self, m: float, n: float, k: float, dtype: str = "bf16", layout: str = "nt"
    ) -> float:
        """Seconds of one (m x k) @ (k x n) matmul (0 for an empty one)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return 2.0 * m * n * k / self.gemm_flops_per_s(m, n, k, dtype, layout)

    @abstractmethod
    def gemm_passes_s(self, m: float, n: float, k: float, dtype: str) -> Passes:
        """(forward, input-gradient, weight-gradient) seconds of a matmul of forward shape
        (m, n, k)."""

    @abstractmethod
    def layer_matmuls_s(self, model: ModelSpec, plan: ParallelPlan, moe: bool) -> Passes:
        """`gemm_passes_s` summed over one layer's matmuls for one micro-batch on one rank, as
        this device runs them."""

    @abstractmethod
    def stream_bytes_per_s(self, kind: str) -> float:
        """Achieved bytes/s of memory-bound kernels of `kind`
        (`fivefold.specs.profile.BANDWIDTH_KINDS`)."""

    @abstractmethod
    def attention_s(
        self, flops: float, span: float, head_dim: float, dtype: str, blocks: int, rows: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of an attention core of `flops` forward FLOPs, on
        `span` tokens a kernel call of width `head_dim`, `rows` = batch x heads, under block
        attention over `blocks` context-parallel ranks (1: none)."""

    @abstractmethod
    def layer_overhead_s(
        self,
        moe: bool = False,
        tp: bool = False,
        zero: int | None = None,
        units: int = 1,
        ep: bool = False,
    ) -> tuple[float, float]:
        """(forward, backward) fixed seconds of one layer and micro-batch beyond its kernels."""

    @abstractmethod
    def kernel_options(self, opts: Options) -> Options:
        """`opts` (`compute.ComputeOptions`) with the kernel choices these rates cannot tell
        apart set to the ones they describe."""

    @abstractmethod
    def local_link(self, size: int, gap_s: float | None) -> FittedLink | None:
        """The link of a group of `size` local ranks when this device priced its own
        collectives (None: the cluster's placement decides, `comm.group_link`)."""

    @abstractmethod
    def collective_gap_s(self, layer_forward_s: Callable[[], float]) -> float | None:
        """Compute seconds before a typical collective when they change its price (None: they
        do not); `layer_forward_s` gives one layer's forward."""

    @abstractmethod
    def shared_cores_step_s(
        self, ranks_per_stage: int, rank_compute: list[float], in_stage_s: float, after_s: float
    ) -> float:
        """The step when ranks share cores that never idle (`estimate.shared_cores_step_s`);
        infinite where ranks do not share cores."""

    @abstractmethod
    def runtime_options(self) -> dict[str, Any]:
        """`PlannerOptions` fields this device sets for fivefold's runtime beyond its facts
        (`options.RUNTIME_FACTS`)."""

    @abstractmethod
    def check_offload(self, plan: ParallelPlan, cluster: ClusterSpec) -> None:
        """Raise `ConfigError` when this device cannot plan `plan.offload`."""


# ---- a catalogued GPU ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogRates(DeviceRates):
    """A catalogued GPU's figures times the efficiency model's fractions."""

    device: GPUSpec
    eff: EfficiencyModel

    def gemm_flops_per_s(self, m: float, n: float, k: float, dtype: str, layout: str) -> float:
        """peak * min(gemm_peak_fraction * I / (I + gemm_half_intensity * ridge), I / ridge),
        I = 2mnk / (e (mk + kn + mn)) FLOP/byte, ridge = peak / HBM bandwidth (the layout
        does not matter)."""
        e = {"fp8": 1, "bf16": 2, "fp16": 2}.get(dtype, 4)
        intensity = 2.0 * m * n * k / (e * (m * k + k * n + m * n))
        peak = self.device.peak(dtype)
        ridge = peak / self.device.hbm_bw_bytes_per_s
        fraction = self.eff.gemm_fraction(self.device.arch) * intensity
        fraction /= intensity + self.eff.gemm_half_intensity * ridge
        fraction = min(fraction, intensity / ridge)  # never above the roofline
        return peak * fraction

    def gemm_passes_s(self, m: float, n: float, k: float, dtype: str) -> Passes:
        """Each backward pass the forward's time (same FLOPs, same bytes)."""
        t = self.gemm_s(m, n, k, dtype)
        return t, t, t

    def layer_matmuls_s(self, model: ModelSpec, plan: ParallelPlan, moe: bool) -> Passes:
        """The fused GEMMs (`layer_gemms`)."""
        dtype = _compute_dtype(plan)
        t = sum(c * self.gemm_s(m, n, k, dtype) for m, n, k, c in layer_gemms(model, plan, moe))
        return t, t, t

    def stream_bytes_per_s(self, kind: str) -> float:
        return self.device.hbm_bw_bytes_per_s * self.eff.hbm_fraction

    def attention_s(
        self, flops: float, span: float, head_dim: float, dtype: str, blocks: int, rows: float
    ) -> tuple[float, float]:
        """Forward at `attention_peak_fraction` of the bf16 peak, backward
        `attention_backward_ratio` times that."""
        peak = self.device.peak(ATTENTION_DTYPE)
        forward = flops / (peak * self.eff.attention_peak_fraction)
        return forward, self.eff.attention_backward_ratio * forward

    def layer_overhead_s(
        self,
        moe: bool = False,
        tp: bool = False,
        zero: int | None = None,
        units: int = 1,
        ep: bool = False,
    ) -> tuple[float, float]:
        """`layer_overhead_s` forward, twice that backward, whatever the layer."""
        return self.eff.layer_overhead_s, 2 * self.eff.layer_overhead_s

    def kernel_options(self, opts: Options) -> Options:
        """All of them: attention kernels and fusion are the options' to choose."""
        return opts

    def local_link(self, size: int, gap_s: float | None) -> None:
        """None: the group's place on the cluster's links decides (`comm.group_link`)."""
        return None

    def collective_gap_s(self, layer_forward_s: Callable[[], float]) -> None:
        """None: the catalog's collectives cost the same after any compute."""
        return None

    def shared_cores_step_s(
        self, ranks_per_stage: int, rank_compute: list[float], in_stage_s: float, after_s: float
    ) -> float:
        """Infinite: every GPU is its own."""
        return math.inf

    def runtime_options(self) -> dict[str, Any]:
        """None beyond fivefold's runtime."""
        return {}

    def check_offload(self, plan: ParallelPlan, cluster: ClusterSpec) -> None:
        """Offload needs the catalog's host of the node (`levers.node_host`)."""
        if offloads(plan, self.device):
            node_host(cluster.gpu, self.device)


def _compute_dtype(plan: ParallelPlan) -> str:
    return recipe(plan.precision).compute_dtype


# ---- a measured device ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MeasuredRates(DeviceRates):
    """A device profile's tables as one of its ranks reads them (`RankProfile`: rates already
    scaled by the rank's threads and share of the cores)."""

    rank: RankProfile
    calibrated = True

    def _dtype(self, dtype: str, rows) -> str:
        """`dtype` when the rows have it, else the first of bf16, fp32 they have."""
        have = {r.dtype for r in rows}
        return dtype if dtype in have else next((d for d in ("bf16", "fp32") if d in have), dtype)

    def gemm_flops_per_s(self, m: float, n: float, k: float, dtype: str, layout: str) -> float:
        """The measured rate at this shape, else interpolated from the `NEIGHBOURS` nearest
        measured shapes of the dtype and layout (every layout when it has none) in log space
        (`log_shape_interp`). The model-independent grid (`DEVICE_GRID`) makes every model's
        shapes fall among measured ones; a shape beyond it takes the rates at its edge
        (`fivefold.planner.rates.coverage` names it)."""
        points, scale = self.gemm_points(dtype, layout)
        return log_shape_interp((max(1.0, m), max(1.0, n), max(1.0, k)), points) * scale

    def gemm_points(self, dtype: str, layout: str) -> tuple[list, float]:
        """((m, n, k), FLOP/s) of the measured GEMMs a pass of `layout` is read from, and the
        factor scaling them to this rank."""
        dtype = self._dtype(dtype, self.rank.profile.matmul)
        rows, scale = self.rank.rows([r for r in self.rank.profile.matmul if r.dtype == dtype])
        same = [r for r in rows if r.layout == layout] or rows
        return [((r.m, r.n, r.k), r.flops_per_s) for r in same], scale

    def gemm_passes_s(self, m: float, n: float, k: float, dtype: str) -> Passes:
        """Forward x W^T on (m, n, k), input gradient g W on (m, k, n), weight gradient g^T x
        on (n, k, m), each at its own measured rate."""
        return (
            self.gemm_s(m, n, k, dtype, "nt"),
            self.gemm_s(m, k, n, dtype, "nn"),
            self.gemm_s(n, k, m, dtype, "tn"),
        )

    def layer_matmuls_s(self, model: ModelSpec, plan: ParallelPlan, moe: bool) -> Passes:
        """Every matmul as eager code runs it (`eager_matmuls`), a MoE layer's routed experts
        as its grouped matmuls (`expert_projections`)."""
        dtype = _compute_dtype(plan)
        shapes = eager_matmuls(model, plan, moe)
        passes = [(c, self.gemm_passes_s(m, n, k, dtype)) for m, n, k, c in shapes]
        fwd, dgrad, wgrad = (sum(c * p[i] for c, p in passes) for i in range(3))
        if moe:
            for shape in expert_projections(model, plan):
                fwd += self.grouped_time_s(*shape, dtype, "nt")
                dgrad += self.grouped_time_s(*shape, dtype, "nn")
                wgrad += self.grouped_time_s(*shape, dtype, "tn")
        return fwd, dgrad, wgrad

    def grouped_time_s(
        self, groups: float, tokens: float, n: float, k: float, dtype: str, layout: str
    ) -> float:
        """Seconds of one pass ("nt", "nn", "tn") of a grouped projection: `tokens` rows over
        `groups` experts, forward shape (tokens / groups x k) @ (k x n) each. From the measured
        grouped rate at the nearest shape of that layout (log distance in groups, tokens, n,
        k); a profile without grouped rows times `groups` separate matmuls instead."""
        flops = 2.0 * tokens * n * k
        if flops <= 0:
            return 0.0
        dtype = dtype if any(r.dtype == dtype for r in self.rank.profile.grouped_matmul) else "fp32"
        rows = [r for r in self.rank.profile.grouped_matmul if r.dtype == dtype]
        rows, scale = self.rank.rows([r for r in rows if r.layout == layout])
        if rows:

            def distance(r: GroupedMatmul) -> float:
                pairs = ((r.groups, groups), (r.tokens, tokens), (r.n, n), (r.k, k))
                return sum(abs(math.log(a / max(b, 1e-9))) for a, b in pairs)

            return flops / (min(rows, key=distance).flops_per_s * scale)
        m = tokens / groups
        shape = {"nt": (m, n, k), "nn": (m, k, n), "tn": (n, k, m)}[layout]
        return groups * 2.0 * m * n * k / self.gemm_flops_per_s(*shape, dtype, layout)

    def stream_bytes_per_s(self, kind: str) -> float:
        return self.rank.bandwidth(kind)

    def attention_flops_per_s(
        self, seq: float, head_dim: float, dtype: str, cp: int = 1, rows: float = 0.0
    ) -> tuple[float, float]:
        """(forward, backward) rate of attention on `seq` local tokens as a function of its
        shape: the rows of the nearest measured cp (context parallelism's block attention over
        `cp` ranks; cp = 1 the single-process core, over the device grid and the calibrated
        models), interpolated in log space over (seq, head_dim, batch x heads) as GEMM rates
        are (`log_shape_interp`); `rows` = batch x heads of the query (0: not used). Rows
        of one document per row ("sdpa"; packed kernels' rows are there to compare)."""
        table, scale = self.attention_table(dtype, cp)

        def shape(a: Attention) -> tuple[float, ...]:
            return (a.seq, a.head_dim, a.batch * a.heads)[: 3 if rows > 0 else 2]

        where = (max(1.0, seq), max(1.0, head_dim), max(1.0, rows))[: 3 if rows > 0 else 2]
        fwd = log_shape_interp(where, [(shape(a), a.forward_flops_per_s) for a in table])
        bwd = log_shape_interp(where, [(shape(a), a.backward_flops_per_s) for a in table])
        return fwd * scale, bwd * scale

    def attention_table(self, dtype: str, cp: int) -> tuple[list[Attention], float]:
        """The one-document attention rows of the nearest measured cp an attention of `dtype`
        is read from, and the factor scaling them to this rank."""
        one_document = [a for a in self.rank.profile.attention if a.kernel == "sdpa"]
        table = [a for a in one_document if a.dtype == dtype] or one_document
        near = min({a.cp for a in table}, key=lambda c: (abs(c - cp), c))
        return self.rank.rows([a for a in table if a.cp == near])

    def attention_s(
        self, flops: float, span: float, head_dim: float, dtype: str, blocks: int, rows: float
    ) -> tuple[float, float]:
        """The measured rates (`attention_flops_per_s`); the backward does 2x the FLOPs."""
        fwd, bwd = self.attention_flops_per_s(span, head_dim, dtype, blocks, rows)
        return flops / fwd, 2.0 * flops / bwd

    def layer_overhead_s(
        self,
        moe: bool = False,
        tp: bool = False,
        zero: int | None = None,
        units: int = 1,
        ep: bool = False,
    ) -> tuple[float, float]:
        """A dense or MoE layer, plus tensor parallelism's extra, expert parallelism's on a MoE
        layer (`ep`) and, when `zero` is given, that of `units` data-parallel units wrapped for
        that ZeRO level (the runtime wraps every block, and under EP a MoE block's experts
        apart: two); a share of the cores stretches them (they run on one thread)."""
        rows, _ = self.rank.rows(list(self.rank.profile.overhead))
        row = rows[0]
        fwd = row.moe_forward_s if moe else row.layer_forward_s
        bwd = row.moe_backward_s if moe else row.layer_backward_s
        if tp:
            fwd, bwd = fwd + row.tp_forward_s, bwd + row.tp_backward_s
        if ep and moe:
            fwd, bwd = fwd + row.ep_forward_s, bwd + row.ep_backward_s
        if zero is not None:
            dp_f, dp_b = row.data_parallel_s(zero)
            fwd, bwd = fwd + units * dp_f, bwd + units * dp_b
        return fwd / self.rank.share, bwd / self.rank.share

    def kernel_options(self, opts: Options) -> Options:
        """The profile measured the runtime's own kernels: its attention core and its bytes
        of element-wise traffic (unfused included) are in the rates already."""
        return replace(opts, attention_kernel="flash", fused_elementwise=True)

    def local_link(self, size: int, gap_s: float | None) -> FittedLink:
        """One machine: every group is local, its link the profile's backend."""
        return FittedLink(self.rank.profile.backend, size, self, gap_s)

    def collective(self, op: str, n: int, gap_s: float | None = None) -> tuple[float, float]:
        """(alpha s, beta bytes/s) of `op` over `n` ranks, each issued after `gap_s` seconds of
        compute (None: the longest gap measured), measured with as many local processes running
        as this run has (else the nearest): linear in the gap between the two measured gaps
        around it, clamped at the ends. An unmeasured group size scales the nearest measured
        one as a ring does: alpha with the n - 1 steps, beta so that the bus bandwidth stays
        the same."""
        rows = [c for c in self.rank.profile.collective if c.op == op]
        if not rows:
            raise ConfigError(
                f"device profile {self.rank.profile.path!r} has no {op} measurement; re-run "
                "`fivefold calibrate` with --nproc 2 or more."
            )
        ranks = self.rank.ranks
        near = nearest_group(rows, n, ranks)
        rows = sorted(
            (c for c in rows if (c.ranks, c.world) == (near.ranks, near.world)),
            key=lambda c: c.gap_s,
        )
        gap = rows[-1].gap_s if gap_s is None else gap_s
        alpha, beta = _between(gap, rows)
        if near.ranks == n:
            return alpha, beta
        steps = (n - 1) / (near.ranks - 1)
        beta *= bus_factor(op, near.ranks) / bus_factor(op, n)
        return alpha * (1 if op == "send_recv" else steps), beta

    def collective_host_s(self, op: str, n: int) -> float:
        """Main-thread seconds the runtime's DTensor redistribution adds to one `op` over `n`
        ranks (`Collective.host_s`, measured on a CPU; 0 when the profile has none): the rows
        of the nearest measured group among as many processes as this run has."""
        rows = [c for c in self.rank.profile.collective if c.op == op]
        if not rows:
            return 0.0
        ranks = self.rank.ranks
        return nearest_group(rows, n, ranks).host_s

    def collective_gap_s(self, layer_forward_s: Callable[[], float]) -> float | None:
        """Half of one layer's forward (tensor parallelism issues two collectives per layer
        forward, data parallelism one per layer backward, twice as long)."""
        return layer_forward_s() / 2

    def shared_cores_step_s(
        self, ranks_per_stage: int, rank_compute: list[float], in_stage_s: float, after_s: float
    ) -> float:
        """On a CPU with a core share below one: every rank's compute at full speed over the
        cores, plus the in-stage collectives' transfer share, plus `after_s`."""
        share = self.rank.share
        if self.rank.profile.kind != "cpu" or share >= 1:
            return math.inf
        full_speed = sum(rank_compute) * ranks_per_stage * share
        cores = full_speed * self.rank.threads / self.rank.profile.cores
        return cores + in_stage_s * share + after_s

    def runtime_options(self) -> dict[str, Any]:
        """On a CPU no CUDA context, no allocator fragmentation and no overlap of the gradient
        reduction; a measured GPU none beyond fivefold's runtime."""
        if self.rank.profile.kind == "cpu":
            return {"cuda_context_bytes": 0.0, "fragmentation_fraction": 0.0, "dp_overlap": False}
        return {}

    def check_offload(self, plan: ParallelPlan, cluster: ClusterSpec) -> None:
        """A CPU holds "offloaded" state in the same memory; a measured GPU has no host figures."""
        prof = self.rank.profile
        if plan.offload != "none" and prof.kind != "cpu":
            raise ConfigError(
                f"plan.offload = {plan.offload!r}: the device profile of {prof.name} has no PCIe "
                "or host-memory figures to plan offload with; set plan.offload = 'none', or plan "
                "on the catalog GPU (--gpu) whose node the catalog describes."
            )


def _between(gap: float, rows: list[Collective]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) at `gap` seconds of compute: alpha and 1 / beta linear between
    the two rows (ascending in gap) around it, a row's own values at or beyond the ends."""
    if gap <= rows[0].gap_s:
        return rows[0].alpha_s, rows[0].beta_bytes_per_s
    for lo, hi in itertools.pairwise(rows):
        if gap < hi.gap_s:
            w = (gap - lo.gap_s) / (hi.gap_s - lo.gap_s)
            alpha = lo.alpha_s + w * (hi.alpha_s - lo.alpha_s)
            inv = 1 / lo.beta_bytes_per_s + w * (1 / hi.beta_bytes_per_s - 1 / lo.beta_bytes_per_s)
            return alpha, 1.0 / inv
    return rows[-1].alpha_s, rows[-1].beta_bytes_per_s


@dataclass(frozen=True)
class FittedLink:
    """A group of `per_node` local ranks on a measured machine (`kind`: the backend, e.g.
    "gloo"), its collectives issued after `gap_s` seconds of compute (None: the longest
    measured): each costs alpha + S / beta as fitted (`MeasuredRates.collective`). The fields
    `comm.Link` prices with are zero here."""

    kind: str
    per_node: int
    rates: MeasuredRates = field(compare=False, repr=False)
    gap_s: float | None = None
    bandwidth: float = 0.0
    latency_s: float = 0.0
    nvlink_bandwidth: float = 0.0
    ib_bandwidth: float = 0.0
    intra_latency_s: float = 0.0

    @property
    def hides_transfers(self) -> bool:
        """Whether a transfer can run behind compute: not on a CPU, whose transport needs the
        cores that compute."""
        return self.rates.rank.profile.kind != "cpu"

    def collective_s(self, op: str, size_bytes: float, n: int) -> float:
        """Seconds of one `op` of `size_bytes` (nccl-tests' convention) over `n` ranks: between
        the measured sizes (`sampled_time_s`), else on the fitted line."""
        alpha, beta = self.rates.collective(op, n, self.gap_s)
        rank = self.rates.rank
        samples = rank.profile.collective_sample
        sampled = sampled_time_s(samples, op, n, rank.ranks, size_bytes, self.gap_s, beta)
        return alpha + size_bytes / beta if sampled is None else sampled

    def host_s(self, op: str, n: int) -> float:
        """The runtime's own CPU per DTensor `op` over `n` ranks (`collective_host_s`)."""
        return self.rates.collective_host_s(op, n)

    def describe(self, pattern: str, n: int) -> str:
        return f"{pattern}, fitted to {self.kind} on this machine (fivefold calibrate)"


def rates_for(device: GPUSpec, eff: EfficiencyModel | None = None) -> DeviceRates:
    """The rates of one rank of `device`: its profile's when it was measured, else the catalog
    figures times `eff` (default: the calibrated efficiency model)."""
    if device.rank_profile is not None:
        return MeasuredRates(device.rank_profile)
    return CatalogRates(device, eff or efficiency_model())
