"""`estimate()`: memory, step time, throughput and MFU of one parallel layout, and its result
(`Estimate`). A step is the pipeline of the chunks' costs (`chunk_costs`, from `layer_costs`)
run through the schedule (`simulation`), plus the slowest rank's tail (`rank_tail`) and the
runtime's per-step synchronisation; memory comes from `memory`. The rules are in
docs/planner.md, sections 2 to 4b. Every user mistake raises `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fivefold.errors import ConfigError
from fivefold.planner.memory.levers import HostMemory, host_memory, memory_plan, offloads
from fivefold.planner.memory.model_states import (
    chunk_layers,
)
from fivefold.planner.memory.stage import StageMemory, all_stage_memory
from fivefold.planner.options import PlannerOptions
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel, efficiency_model
from fivefold.planner.schedule.actions import build_schedule
from fivefold.planner.schedule.simulation import Simulation, StageCosts, analytic_pipeline, simulate
from fivefold.planner.step_time.chunk_costs import ChunkCosts, chunk_costs_of
from fivefold.planner.step_time.comm import (
    Link,
    all_reduce_time_s,
    axis_groups,
    group_link,
    link_model,
    p2p_time_s,
    pipeline_link,
    plan_link,
    stage_boundary_bytes,
)
from fivefold.planner.step_time.layer_costs import collective_gap_s, layer_cost_key, routing_sync_s
from fivefold.planner.step_time.lever_costs import mfu_peak
from fivefold.planner.step_time.rank_tail import Tail, rank_tails
from fivefold.specs.cluster import ClusterSpec, require_hbm
from fivefold.specs.flops import training_flops_per_token
from fivefold.specs.geometry import (
    chunks_of_rank,
)
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.optimizer import optimizer_plan_problems
from fivefold.specs.partition import stage_layer_counts
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe
from fivefold.units import GiB


@dataclass(frozen=True)
class CommCost:
    """One kind of communication over a step, for the worst rank: bytes it sends, the time the
    transfers take, the part of that time on the critical path, and how the link was priced
    (`comm.link_model`, e.g. "p2p, slowest hop ib 45 GB/s per GPU")."""

    kind: str
    link: str
    bytes_per_step: float
    time_s: float
    exposed_s: float
    link_model: str = ""

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "link": self.link,
            "link_model": self.link_model,
            "bytes_per_step": self.bytes_per_step,
            "time_s": self.time_s,
            "exposed_s": self.exposed_s,
        }


@dataclass
class Estimate:
    """Everything the planner predicts for one layout. Times in seconds, memory in bytes."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: ParallelPlan
    options: PlannerOptions
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    bubble_fraction: float  # busiest rank's idle / pipeline time = pipeline_bubble_s / that time
    memory: list[StageMemory]
    worst_stage: int
    hbm_bytes: float
    compute_time_s: float
    comm: list[CommCost]
    breakdown_s: dict[str, float]
    stage_costs: StageCosts
    layer_counts: list[int]
    peak_inflight: list[int]
    host_memory: HostMemory | None = None  # offloaded state against the node's host RAM
    _simulation: Simulation | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory[self.worst_stage].total <= self.hbm_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_memory is None or self.host_memory.fits

    @property
    def worst_memory(self) -> StageMemory:
        return self.memory[self.worst_stage]

    @property
    def peak_memory_bytes(self) -> float:
        return self.worst_memory.total

    def fits_with(self, headroom: float) -> bool:
        """True when the worst stage leaves `headroom` (a fraction of HBM) free."""
        return self.worst_memory.total <= (1.0 - headroom) * self.hbm_bytes

    @cached_property
    def simulation(self) -> Simulation:
        """The pipeline simulation (run on demand when the estimate skipped it, pp == 1)."""
        if self._simulation is not None:
            return self._simulation
        sched = build_schedule(
            _schedule_name(self.plan), self.plan.pp, self.plan.vpp, self.plan.grad_accum
        )
        return simulate(sched, self.stage_costs)

    def timeline(self) -> list[list[dict]]:
        return [
            [
                {
                    "kind": ev.kind,
                    "microbatch": ev.microbatch,
                    "chunk": ev.chunk,
                    "start_s": ev.start_s,
                    "end_s": ev.end_s,
                }
                for ev in rank
            ]
            for rank in self.simulation.events
        ]

    def to_json(self, timeline: bool = True) -> dict:
        """The stable JSON shape of `fivefold plan --json` (see the shared interfaces)."""
        return {
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble_fraction": self.bubble_fraction,
            "memory_gib": self.worst_memory.gib(),
            "hbm_gib": self.hbm_bytes / GiB,
            "worst_stage": self.worst_stage,
            "memory_per_stage_gib": [m.gib() for m in self.memory],
            "other_gib": self.worst_memory.other_gib(),
            "compute_time_s": self.compute_time_s,
            "comm": [c.to_json() for c in self.comm],
            "breakdown_s": dict(self.breakdown_s),
            "layers_per_stage": list(self.layer_counts),
            "timeline": self.timeline() if timeline else [],
            "precision": self.plan.precision,
            "host_memory": self.host_memory.to_json() if self.host_memory else None,
            "plan": self.plan.to_dict(),
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
        }


def _schedule_name(plan: ParallelPlan) -> str:
    return plan.schedule if plan.pp > 1 else "1f1b"


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    options: PlannerOptions | None = None,
    efficiency: EfficiencyModel | None = None,
    pipeline: str = "simulate",
    *,
    runtime: bool | None = None,
) -> Estimate:
    """Predict memory, step time, tokens/s, MFU and HFU of `plan` for `model` on `cluster`.

    `pipeline="simulate"` runs the schedule's event simulation (exact for the stage costs, a few
    ms for deep pipelines with many micro-batches); `"analytic"` uses the closed forms
    generalised to unequal stages (`analytic_pipeline`), microseconds, for searches that
    simulate only their finalists. Raises `ConfigError` listing every problem when the plan is
    invalid for them. The rules of fivefold's own runtime (`ParallelPlan.problems`) bind
    options describing it (`PlannerOptions.fivefold_runtime`, the default); `runtime` True or
    False says so explicitly (False: runs made by other software, such as the published ones).
    """
    opts = options or PlannerOptions.for_device(cluster.device)
    runtime = opts.fivefold_runtime if runtime is None else runtime
    eff = efficiency or efficiency_model()
    if pipeline not in ("simulate", "analytic"):
        raise ConfigError(f"pipeline = {pipeline!r}: choose 'simulate' or 'analytic'.")
    _validate(model, cluster, plan, opts, runtime)
    device = cluster.device
    counts = stage_layer_counts(model, plan.pp * plan.vpp)
    key = layer_cost_key(plan)
    last = len(counts) - 1
    chunk_sigs = [(*chunk_layers(model, counts, c), c == 0, c == last) for c in range(last + 1)]
    chunk_costs = [chunk_costs_of(model, key, cluster, eff, opts, *sig) for sig in chunk_sigs]
    m = plan.grad_accum
    gap = collective_gap_s(model, plan, cluster, eff)
    costs, boundary, pp_link = _stage_costs(
        model, plan, cluster, eff, opts, chunk_sigs, chunk_costs, gap
    )
    pipeline_s, busy, inflight, sim = _run_pipeline(plan, costs, pipeline)
    tails = rank_tails(model, plan, cluster, eff, opts, chunk_sigs, chunk_costs)
    sync = runtime_sync_s(plan, cluster, eff, opts, gap)
    step = pipeline_s + max(t.exposed_s for t in tails) + sync
    memory = all_stage_memory(model, memory_plan(plan, device), inflight, opts.memory())
    host = None
    if offloads(plan, device):
        per_gpu = max(mem.host_bytes for mem in memory)
        host = host_memory(per_gpu, cluster.gpus_per_node, cluster.gpu, device)
    step, breakdown, rank_compute, busiest = _step_breakdown(
        plan, device, chunk_costs, busy, pipeline_s, tails, sync, step
    )
    comm = _comm_summary(
        plan, cluster, eff, opts, chunk_costs, tails, busiest, m, costs.p2p_s, boundary, pp_link
    )
    global_tokens, model_flops, hw_flops, peak = _flops(model, plan, cluster, opts)
    return Estimate(
        model=model,
        cluster=cluster,
        plan=plan,
        options=opts,
        step_time_s=step,
        tokens_per_s=global_tokens / step,
        mfu=model_flops / (step * peak),
        hfu=hw_flops / (step * peak),
        bubble_fraction=breakdown["pipeline_bubble_s"] / pipeline_s if pipeline_s > 0 else 0.0,
        memory=memory,
        worst_stage=max(range(plan.pp), key=lambda r: memory[r].total),
        hbm_bytes=float(device.hbm_bytes),
        compute_time_s=max(rank_compute),
        comm=comm,
        breakdown_s=breakdown,
        stage_costs=costs,
        layer_counts=counts,
        peak_inflight=inflight,
        host_memory=host,
        _simulation=sim,
    )


def _step_breakdown(
    plan: ParallelPlan,
    device: GPUSpec,
    chunk_costs: list[ChunkCosts],
    busy: list[float],
    pipeline_s: float,
    tails: list[Tail],
    sync: float,
    step: float,
) -> tuple[float, dict[str, float], list[float], int]:
    """(the step after core sharing, `Estimate.breakdown_s`, compute seconds per pipeline rank,
    the busiest rank) of a step of `step` seconds before core sharing."""
    m = plan.grad_accum
    placed = [chunks_of_rank(plan.schedule, plan.pp, plan.vpp, r) for r in range(plan.pp)]
    rank_compute = [m * sum(chunk_costs[c].compute_s for c in chunks) for chunks in placed]
    busiest = max(range(plan.pp), key=lambda r: busy[r])
    in_stage = _excess(busy[busiest], rank_compute[busiest])
    shared = shared_cores_step_s(plan, device, rank_compute, in_stage, step - pipeline_s)
    core_sharing = min(0.0, shared - step)
    step += core_sharing
    # The step pays the busiest rank's idle time; the fraction and the seconds are that one figure.
    bubble_s = _excess(pipeline_s, busy[busiest])
    slowest_tail = max(tails, key=lambda t: t.exposed_s)
    breakdown = {
        "compute_s": rank_compute[busiest],
        "in_stage_comm_s": in_stage,
        "pipeline_bubble_s": bubble_s,
        "dp_grad_exposed_s": slowest_tail.grad_exposed_s,
        "param_gather_exposed_s": slowest_tail.gather_exposed_s,
        "optimizer_s": slowest_tail.optimizer_s,
        "offload_exposed_s": slowest_tail.offload_exposed_s,
        "runtime_sync_s": sync,
        "core_sharing_s": core_sharing,
    }
    return step, breakdown, rank_compute, busiest


def _stage_costs(
    model: ModelSpec,
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    chunk_sigs: list[tuple[int, int, bool, bool]],
    chunk_costs: list[ChunkCosts],
    gap: float | None,
) -> tuple[StageCosts, float, Link]:
    """(the schedule's stage costs, bytes sent between stages per micro-batch, the pipeline's
    link): the chunks' F, B, W seconds with the MoE routing synchronisation of fivefold's
    runtime (re-run with full recompute), and the point-to-point time between stages. On a
    measured device (`gap` not None) a send follows a chunk's whole forward of a micro-batch,
    not a layer's share: the link is read at the chunks' mean forward seconds."""
    boundary = stage_boundary_bytes(model, plan)
    send_gap = None if gap is None else sum(c.forward_s for c in chunk_costs) / len(chunk_costs)
    pp_link = pipeline_link(cluster, plan, eff, send_gap)
    p2p = p2p_time_s(boundary, pp_link) if plan.pp > 1 else 0.0
    routing = 0.0
    if model.is_moe and opts.runtime == "fivefold-eager":
        routing = routing_sync_s(model, plan, cluster, eff)
    rerun = 1.0 if plan.recompute == "full" else 0.0  # full recompute re-runs the forward's
    pairs = list(zip(chunk_costs, chunk_sigs, strict=True))
    costs = StageCosts(
        tuple(c.forward_s + sig[1] * routing for c, sig in pairs),
        tuple(c.backward_input_s + rerun * sig[1] * routing for c, sig in pairs),
        tuple(c.backward_weight_s for c in chunk_costs),
        p2p,
    )
    return costs, boundary, pp_link


def _run_pipeline(
    plan: ParallelPlan, costs: StageCosts, pipeline: str
) -> tuple[float, list[float], list[int], Simulation | None]:
    """(pipeline seconds, busy seconds per rank, peak in-flight micro-batches per rank, the
    simulation when one ran). Without pipelining the step is m * (F + B + W)."""
    m = plan.grad_accum
    sim: Simulation | None = None
    if plan.pp == 1:
        pipeline_s = m * (
            costs.forward_s[0] + costs.backward_input_s[0] + costs.backward_weight_s[0]
        )
        return pipeline_s, [pipeline_s], [1], sim
    sched = build_schedule(plan.schedule, plan.pp, plan.vpp, m)
    inflight = list(sched.peak_inflight)
    if pipeline == "simulate":
        sim = simulate(sched, costs)
        pipeline_s, busy = sim.step_time_s, list(sim.busy_s)
    else:
        pipeline_s, busy = analytic_pipeline(plan, costs)
    return pipeline_s, busy, inflight, sim


def _flops(
    model: ModelSpec, plan: ParallelPlan, cluster: ClusterSpec, opts: PlannerOptions
) -> tuple[float, float, float, float]:
    """(tokens per step, model FLOPs, hardware FLOPs (with recomputation) per step, the
    cluster's peak FLOP/s for MFU, `lever_costs.mfu_peak`)."""
    global_tokens = plan.global_batch * model.seq_len
    peak = mfu_peak(model, plan, cluster.device) * cluster.world_size
    model_flops = training_flops_per_token(model, model.seq_len, "none") * global_tokens
    hw_flops = training_flops_per_token(
        model, model.seq_len, plan.recompute, early_stop=opts.checkpoint_early_stop
    )
    hw_flops *= global_tokens
    return global_tokens, model_flops, hw_flops, peak


def shared_cores_step_s(
    plan: ParallelPlan,
    device: GPUSpec,
    rank_compute: list[float],
    in_stage_s: float,
    after_s: float,
) -> float:
    """On a CPU whose ranks outnumber its cores (a measured device with a core share below
    one), the step when the cores never idle (infinite elsewhere; `estimate` takes the smaller
    of this and its pipeline's step). The shared rates assume every rank computes all the
    time, but a rank waiting for a pipeline neighbour sleeps and leaves its core to the others:
    so every rank's compute at full speed, over the cores; plus the busiest rank's in-stage
    collectives (`in_stage_s`, priced among as many processes as cores: the share of it that
    is transfer, not waiting for a peer's core, which the compute term already counts); plus
    `after_s`, what all ranks do together after the pipeline (gradient reduction, the
    runtime's synchronisations). `rank_compute`: each pipeline rank's compute at the shared
    rates, seconds (`DeviceRates.shared_cores_step_s`)."""
    ranks_per_stage = plan.world_size // plan.pp
    return rates_for(device).shared_cores_step_s(ranks_per_stage, rank_compute, in_stage_s, after_s)


def _excess(total_s: float, part_s: float) -> float:
    """`total_s - part_s` when it exceeds float residue (1e-9 relative), else 0."""
    excess = total_s - part_s
    return 0.0 if excess <= 1e-9 * max(abs(total_s), abs(part_s)) else excess


def runtime_sync_s(
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    gap: float | None = None,
) -> float:
    """fivefold's runtime (`opts.runtime == "fivefold-eager"`) adds two scalar all-reduces to
    every step: the global token count over the data-parallel ranks before the first forward
    (the loss scale) and the loss mean over the world after the last backward; each costs a
    collective's latency and nothing hides it."""
    if opts.runtime != "fivefold-eager":
        return 0.0
    total = 0.0
    for n, size in ((plan.dp, 8.0), (plan.world_size, 16.0)):
        if n > 1:
            total += all_reduce_time_s(size, n, group_link(cluster, n, 1, eff, gap))
    return total


def _validate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: ParallelPlan,
    opts: PlannerOptions,
    runtime: bool = True,
) -> None:
    plan.validate(model, cluster, runtime=runtime)
    opts.validate()
    problems = optimizer_plan_problems(opts.optimizer, plan, "planner.optimizer")
    if problems:
        raise ConfigError(problems)
    device: GPUSpec = cluster.device
    device.peak(recipe(plan.precision).compute_dtype)  # "unknown peak" for e.g. the CPU
    if plan.fp8 != "none":
        device.peak("fp8")  # FP8 compute needs an FP8 peak (not on an A100)
    rates_for(device).check_offload(plan, cluster)  # the host RAM and bandwidth offload needs
    require_hbm(cluster)


def _comm_summary(
    plan: ParallelPlan,
    cluster: ClusterSpec,
    eff: EfficiencyModel,
    opts: PlannerOptions,
    chunk_costs: list[ChunkCosts],
    tails: list[Tail],
    rank: int,
    m: int,
    p2p: float,
    boundary: float,
    pp_link: Link,
) -> list[CommCost]:
    """Every kind of communication over a step of pipeline rank `rank` (the busiest)."""
    chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
    out: list[CommCost] = []
    cp_pattern = {"ring": "p2p", "allgather": "collective"}.get(plan.cp_kind, "all-to-all")
    ep_pattern = "dispatch" if opts.ep_dispatch == "deepep" else "all-to-all"

    def add(
        kind: str, group: str, triple: tuple[float, float, float], pattern: str = "collective"
    ) -> None:
        exposed, time, sent = triple
        if time <= 0 and sent <= 0:
            return
        link = plan_link(cluster, plan, group, eff)
        words = link_model(link, pattern, axis_groups(plan)[group][0])
        out.append(CommCost(kind, link.kind, sent, time, exposed, words))

    def total(attr: str) -> tuple[float, float, float]:
        parts = [getattr(chunk_costs[c], attr) for c in chunks]
        return tuple(m * sum(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]

    add("tp", "tp", total("tp"))
    add("cp", "cp", total("cp"), cp_pattern)
    add("ep", "ep", total("ep"), ep_pattern)
    tail = tails[rank]
    zero = total("zero")
    zero_gather = (
        zero[0] + tail.gather_exposed_s,
        zero[1] + tail.gather_time_s,
        zero[2] + tail.gather_bytes,
    )
    add("zero-gather", "dp_shard_cp", zero_gather)
    if plan.pp > 1:
        hops = 2 * m * plan.vpp
        critical = 2 * (plan.pp * plan.vpp - 1) * p2p
        words = link_model(pp_link, "p2p", 2)
        out.append(CommCost("pp", pp_link.kind, hops * boundary, hops * p2p, critical, words))
    dp_group = "dp_cp" if plan.zero == 0 else "dp_shard_cp"
    rs = total("zero_rs")
    add(
        "dp",
        dp_group,
        (tail.grad_exposed_s + rs[0], tail.grad_time_s + rs[1], tail.grad_bytes + rs[2]),
    )
    if tail.offload_time_s > 0:  # "all" offload's per-layer copies are in the zero-gather times
        out.append(
            CommCost(
                "offload",
                "pcie",
                tail.offload_bytes,
                tail.offload_time_s,
                tail.offload_exposed_s,
                "host copies over PCIe",
            )
        )
    return out
