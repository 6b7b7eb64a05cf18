"""Communication costs: which link a process group uses, and alpha-beta times of collectives.

Placement. Ranks are placed node-major and the mesh is, outer to inner, pp, dp_replicate,
dp_shard, cp, tp (`fivefold.specs.geometry`), so the ranks of a group along one axis are `stride`
apart, where the stride is the product of the inner degrees (tp: 1, cp: tp, dp_shard: tp*cp, ...).
A group of `size` ranks `stride` apart stays in one node when size * stride <= gpus_per_node;
otherwise it spans nodes with k = max(1, gpus_per_node // stride) members per node. Where one
NVLink fabric joins several nodes (`ClusterSpec.nvlink_domain`, GB200 NVL72) the domain takes
the node's place: a group inside it stays on NVLink.

Bandwidth. NVLink moves ring traffic one way, so a GPU gets half the marketed (bidirectional)
`intra_node_bw`, times `nvlink_fraction`. A ring that crosses nodes leaves each node once per
ring; NCCL runs one ring per NIC, so the node's k members of the group share k NICs and the ring's
bus bandwidth is min(NVLink, k * inter_node_bw * ib_fraction). That is why data parallelism over
eight GPUs per node can reach hundreds of GB/s although each NIC carries 50 GB/s.
Point-to-point exchanges get no such sharing: in a ring attention step or a pipeline send every
rank sends to its neighbour at once, the step waits for its slowest hop, and a hop that leaves
the node goes through the sending GPU's own NIC: B_p2p = min(NVLink, inter_node_bw * ib_fraction)
once the group spans nodes (`Link.p2p_bandwidth`). An all-to-all sends the part of its traffic
that leaves the node, (n-k)/n, through each GPU's own NIC as well.

Costs (Thakur, Rabenseifner and Gropp 2005; Chan et al. 2007), per GPU, for S bytes per rank,
with a group of n ranks on N nodes (k = n / N per node):
    all-reduce (ring)          L_ring + 2 (n-1)/n * S / B
    all-reduce (tree)          L_tree + 2 S / (TREE_BW_FRACTION * B)
    all-gather, reduce-scatter L_ring +   (n-1)/n * S / B   (S = the full, gathered size)
    all-to-all                   (n-1) alpha + max((k-1)/n * S / B_nvlink, (n-k)/n * S / B_ib)
    dispatch, deduplicated     (n-1) alpha + max((k-1)/k * S / B_nvlink, R * S / (top_k B_ib))
        (DeepEP: one network copy per remote node reached, R = (N-1)(1 - (1 - 1/N)^top_k))
    point-to-point                     alpha + S / B_p2p
Latency as NCCL's own cost model counts it (`src/graph/tuning.cc`, `ncclTopoTuneModel`): a ring
takes 2(n-1) steps for an all-reduce (n-1 for a gather or scatter), of which 2(N-1) (N-1) cross
the network at alpha_ib and the rest stay on NVLink at alpha_nvlink; NCCL's double binary tree
takes 2 ((k-1) alpha_nvlink + floor(log2 N) alpha_ib) and reaches 0.9 of the ring's bus bandwidth
at half the algorithm bandwidth (2 S / B). NCCL times every algorithm for each call and runs the
fastest; so does `all_reduce_time_s` (`nccl_algorithm` says which). Only all-reduce has a tree;
gathers and scatters are rings. Not modelled: NCCL's LL/LL128 protocols (low latency for small
messages), its per-size tree correction table and NVLS/CollNet (switch offload).

Granularity. A framework does not issue one collective per step: DDP and Megatron's distributed
optimizer reduce gradients in buckets of `dp_bucket_bytes`, FSDP/ZeRO-3 per layer (the wrapped
module), DeepSpeed-style per-parameter hooks per tensor. `collective_count` turns the choice
(`PlannerOptions.collective_granularity`: "bucket" | "layer" | "parameter") into a count and
`issued_time_s` charges each collective its own latency: count * T(S / count). Over 1,000+ ranks
the latency term, not the bandwidth, is what makes small per-rank collectives slow.

On a machine measured by `fivefold calibrate` (`fivefold.specs.profile`) every group is local
(one machine; the link's kind is the backend, e.g. "gloo") and each collective costs alpha + S /
beta with the alpha and beta fitted to its own measurements on that group size
(`rates.FittedLink`, `rates.MeasuredRates.collective`), S in the nccl-tests convention used
above, as issued after the link's `gap_s` of compute on every rank (the estimator passes its
plan's, `layer_costs.collective_gap_s`): on a CPU a collective issued between GEMMs costs several
times one issued back to back.
Written by hand: no library computes these without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.planner.rates.device import FittedLink, rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.geometry import axis_groups, rank_tokens, sequence_shard_divisor
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe


@dataclass(frozen=True)
class Link:
    """What one rank of a group gets: `kind` "nvlink" | "ib", achieved one-way bus bandwidth in
    bytes/s, the per-hop latency in seconds (alpha_ib for a group across nodes), the group's
    members per node, and the NVLink hop latency of the steps that stay inside a node. A
    measured machine's groups have a `rates.FittedLink` instead, priced alike by its fits."""

    kind: str
    bandwidth: float
    latency_s: float
    per_node: int
    nvlink_bandwidth: float
    ib_bandwidth: float
    intra_latency_s: float = 0.0
    hides_transfers = True  # a transfer may run behind compute (GPU copy engines, NICs)

    def nodes(self, n: int) -> int:
        """Nodes a group of `n` ranks spans on this link (1 on NVLink)."""
        return 1 if self.kind != "ib" else max(1, math.ceil(n / self.per_node))

    @property
    def p2p_bandwidth(self) -> float:
        """One-way bytes/s of a point-to-point exchange between neighbours of the group: every
        rank sends at once, so the exchange waits for its slowest hop, and a hop to another node
        is one GPU's own NIC (`ib_bandwidth`), whatever the other NICs of the node do."""
        if self.kind == "ib":
            return min(self.nvlink_bandwidth, self.ib_bandwidth)
        return self.bandwidth

    def collective_s(self, op: str, size_bytes: float, n: int) -> float:
        """Seconds of one `op` (`fivefold.specs.profile.COLLECTIVES`) of `size_bytes` over `n`
        ranks by the analytic models below (the module doc)."""
        return _ANALYTIC[op](size_bytes, n, self)

    def host_s(self, op: str, n: int) -> float:
        """The runtime's own CPU per DTensor collective: none counted on a GPU, whose host runs
        ahead of its kernels (a measured CPU's is `FittedLink.host_s`)."""
        return 0.0

    def describe(self, pattern: str, n: int) -> str:
        """`link_model` of this link."""
        return _placed_model(self, pattern, n)


def local_link(
    cluster: ClusterSpec, size: int, eff: EfficiencyModel, gap_s: float | None = None
) -> FittedLink | None:
    """The link of a group of `size` ranks on a device that priced its own collectives, issued
    after `gap_s` seconds of compute (`DeviceRates.local_link`), or None for a GPU cluster."""
    return rates_for(cluster.device, eff).local_link(size, gap_s)


def nvlink_bandwidth(cluster: ClusterSpec, eff: EfficiencyModel) -> float:
    """Achieved one-way NVLink bandwidth per GPU (bytes/s)."""
    return cluster.intra_node_bw / 2 * eff.nvlink_fraction


def ib_bandwidth(cluster: ClusterSpec, eff: EfficiencyModel) -> float:
    """Achieved one-way inter-node bandwidth per GPU (bytes/s), one NIC per GPU."""
    return cluster.inter_node_bw * eff.ib_fraction


def group_link(
    cluster: ClusterSpec, size: int, stride: int, eff: EfficiencyModel, gap_s: float | None = None
) -> Link:
    """The link a group of `size` ranks, `stride` apart in node-major order, communicates over
    (`gap_s`: compute before each collective, for a measured device)."""
    local = local_link(cluster, size, eff, gap_s)
    if local is not None:
        return local
    g = cluster.nvlink_gpus  # a node, or an NVLink domain of several (GB200 NVL72: 72)
    nv = nvlink_bandwidth(cluster, eff)
    ib = ib_bandwidth(cluster, eff)
    if size * stride <= g or cluster.world_size <= g:
        return Link("nvlink", nv, cluster.intra_node_latency_s, size, nv, ib)
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    bandwidth = min(nv, per_node * ib)
    return Link(
        "ib",
        bandwidth,
        cluster.inter_node_latency_s,
        per_node,
        nv,
        ib,
        cluster.intra_node_latency_s,
    )


# ---- the groups of a plan (`fivefold.specs.geometry.axis_groups`) -------------------------------
def plan_link(
    cluster: ClusterSpec,
    plan: ParallelPlan,
    group: str,
    eff: EfficiencyModel,
    gap_s: float | None = None,
) -> Link:
    size, stride = axis_groups(plan)[group]
    return group_link(cluster, size, stride, eff, gap_s)


def pipeline_link(
    cluster: ClusterSpec, plan: ParallelPlan, eff: EfficiencyModel, gap_s: float | None = None
) -> Link:
    """The link of the sends between neighbouring pipeline stages, world/pp ranks apart: "ib" as
    soon as one boundary crosses nodes (a schedule waits for its slowest boundary), priced by
    `p2p_time_s` at one GPU's NIC."""
    local = local_link(cluster, 2, eff, gap_s)
    if local is not None:
        return local
    return plan_link(cluster, plan, "pp", eff)


# ---- collective times ----------------------------------------------------------------------------
def activation_bytes(tokens: float, hidden: int, element_bytes: float = 2) -> float:
    """Size of one activation tensor of `tokens` x `hidden` (what a TP collective moves)."""
    return tokens * hidden * element_bytes


def stage_boundary_bytes(model: ModelSpec, plan: ParallelPlan) -> float:
    """Bytes a pipeline stage sends the next per micro-batch: its output activations,
    sequence-sharded under SP."""
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    e = recipe(plan.precision).activation_bytes
    return activation_bytes(tokens, model.hidden, e) / sequence_shard_divisor(plan.sp, plan)


def all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes a rank sends in a ring all-reduce of `size_bytes`: 2 (n-1)/n * S."""
    return 2 * (n - 1) / n * size_bytes if n > 1 else 0.0


def all_gather_bytes(size_bytes: float, n: int) -> float:
    """Bytes a rank sends in a ring all-gather (or reduce-scatter) of S gathered bytes."""
    return (n - 1) / n * size_bytes if n > 1 else 0.0


def transfer_time_s(size_bytes: float, bandwidth: float, latency_s: float = 0.0) -> float:
    """alpha + S / B: the time to move `size_bytes` over a link."""
    return latency_s + size_bytes / bandwidth


TREE_BW_FRACTION = 0.9  # NCCL's tree reaches 0.9 of the ring's bus bandwidth (tuning.cc)
GRANULARITIES = ("bucket", "layer", "parameter")
TENSORS_PER_LAYER = 9  # a Llama block: two norms, wq, wk, wv, wo, w1, w2, w3


def ring_latency_s(n: int, link: Link, all_reduce: bool = True) -> float:
    """NCCL's ring latency: 2(n-1) steps for an all-reduce (n-1 for a gather or scatter), of
    which 2(N-1) (N-1) cross nodes at alpha_ib and the rest stay on NVLink."""
    steps = (2 if all_reduce else 1) * (n - 1)
    if link.kind != "ib":
        return steps * link.latency_s
    inter = (2 if all_reduce else 1) * (link.nodes(n) - 1)
    return (steps - inter) * link.intra_latency_s + inter * link.latency_s


def tree_latency_s(n: int, link: Link) -> float:
    """NCCL's double-binary-tree all-reduce latency: 2 ((k-1) alpha_nvlink + floor(log2 N)
    alpha_ib), a chain of k ranks inside each node and a tree over the N nodes."""
    if link.kind != "ib":
        return 2 * (n - 1) * link.latency_s
    nodes = link.nodes(n)
    per_node = n // nodes
    return 2 * ((per_node - 1) * link.intra_latency_s + int(math.log2(nodes)) * link.latency_s)


def ring_all_reduce_time_s(size_bytes: float, n: int, link: Link) -> float:
    return ring_latency_s(n, link) + all_reduce_bytes(size_bytes, n) / link.bandwidth


def tree_all_reduce_time_s(size_bytes: float, n: int, link: Link) -> float:
    return tree_latency_s(n, link) + 2 * size_bytes / (TREE_BW_FRACTION * link.bandwidth)


def nccl_algorithm(size_bytes: float, n: int, link: Link) -> str:
    """ "ring" or "tree": the all-reduce algorithm NCCL's cost model picks (the faster one)."""
    ring = ring_all_reduce_time_s(size_bytes, n, link)
    return "tree" if tree_all_reduce_time_s(size_bytes, n, link) < ring else "ring"


def all_reduce_time_s(size_bytes: float, n: int, link: Link) -> float:
    """All-reduce of `size_bytes` over `n` ranks with the algorithm NCCL would pick."""
    return link.collective_s("all_reduce", size_bytes, n) if n > 1 else 0.0


def _nccl_all_reduce_s(size_bytes: float, n: int, link: Link) -> float:
    ring = ring_all_reduce_time_s(size_bytes, n, link)
    if link.kind != "ib":
        return ring  # inside a node the tree is a chain: the ring's latency, less bandwidth
    return min(ring, tree_all_reduce_time_s(size_bytes, n, link))


def all_gather_time_s(size_bytes: float, n: int, link: Link) -> float:
    """Ring all-gather (the same for reduce-scatter) of `size_bytes` gathered bytes."""
    return _gather_or_scatter("all_gather", size_bytes, n, link)


def reduce_scatter_time_s(size_bytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of `size_bytes` (the whole input): the all-gather's cost."""
    return _gather_or_scatter("reduce_scatter", size_bytes, n, link)


def _gather_or_scatter(op: str, size_bytes: float, n: int, link: Link) -> float:
    return link.collective_s(op, size_bytes, n) if n > 1 else 0.0


def _ring_gather_s(size_bytes: float, n: int, link: Link) -> float:
    return ring_latency_s(n, link, all_reduce=False) + all_gather_bytes(size_bytes, n) / (
        link.bandwidth
    )


def collective_count(
    size_bytes: float, granularity: str, bucket_bytes: float, layers: float, tensors: int
) -> int:
    """How many collectives a framework issues to move `size_bytes` of `layers` layers'
    gradients or parameters: one per `bucket_bytes` ("bucket"), one per layer ("layer"), one
    per tensor ("parameter", `tensors` per layer). At least one."""
    if granularity == "bucket":
        return max(1, math.ceil(size_bytes / bucket_bytes))
    if granularity == "layer":
        return max(1, math.ceil(layers))
    if granularity == "parameter":
        return max(1, math.ceil(layers * tensors))
    raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")


def issued_time_s(op, size_bytes: float, n: int, link: Link, count: int) -> float:
    """`count` collectives `op` (e.g. `all_reduce_time_s`) of size_bytes / count each: every one
    pays its own latency."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return count * op(size_bytes / count, n, link)


def all_to_all_time_s(size_bytes: float, n: int, link: Link) -> float:
    """Each rank sends (n-1)/n of `size_bytes`: on-node parts over NVLink, the rest over its NIC."""
    return link.collective_s("all_to_all", size_bytes, n) if n > 1 else 0.0


def _split_all_to_all_s(size_bytes: float, n: int, link: Link) -> float:
    k = min(link.per_node, n)
    if link.kind == "nvlink":
        return (n - 1) * link.latency_s + (n - 1) / n * size_bytes / link.nvlink_bandwidth
    on_node = (k - 1) / n * size_bytes / link.nvlink_bandwidth
    off_node = (n - k) / n * size_bytes / link.ib_bandwidth
    return (n - 1) * link.latency_s + max(on_node, off_node)


EP_DISPATCHES = ("alltoall", "deepep")


def deduplicated_dispatch_time_s(token_bytes: float, top_k: int, n: int, link: Link) -> float:
    """DeepEP's dispatch (or combine) of a rank's tokens, `token_bytes` in all, each routed to
    `top_k` experts of an EP group of n ranks on N nodes (DeepSeek-V3 report, section 3.2.2): a
    token crosses the network once per remote node holding one of its experts, then is
    forwarded over NVLink to those experts. With uniform routing a token reaches
    N (1 - (1 - 1/N)^top_k) nodes, (N-1)/N of them remote; the plain all-to-all sends one copy
    per expert instead. Inside one node (or on a measured machine) it is that all-to-all."""
    if n <= 1:
        return 0.0
    if link.kind != "ib":  # also a measured machine's local link
        return all_to_all_time_s(token_bytes * top_k, n, link)
    nodes = link.nodes(n)
    k = min(link.per_node, n)
    remote_nodes = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
    off_node = remote_nodes * token_bytes / link.ib_bandwidth
    on_node = (k - 1) / k * top_k * token_bytes / link.nvlink_bandwidth
    return (n - 1) * link.latency_s + max(on_node, off_node)


def p2p_time_s(size_bytes: float, link: Link) -> float:
    """One point-to-point exchange of `size_bytes` per rank between neighbours of a group (a
    ring attention step, a pipeline send): alpha + S / B at the slowest hop's bandwidth
    (`Link.p2p_bandwidth`), not the multi-NIC bus bandwidth of a collective."""
    return link.collective_s("send_recv", size_bytes, 2)


def _slowest_hop_s(size_bytes: float, n: int, link: Link) -> float:
    return transfer_time_s(size_bytes, link.p2p_bandwidth, link.latency_s)


_ANALYTIC = {
    "all_reduce": _nccl_all_reduce_s,
    "all_gather": _ring_gather_s,
    "reduce_scatter": _ring_gather_s,
    "all_to_all": _split_all_to_all_s,
    "send_recv": _slowest_hop_s,
}


# ---- the assumption behind a price, in words -------------------------------------------------
PATTERNS = ("collective", "p2p", "all-to-all", "dispatch")


def _gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:,.0f} GB/s"


def link_model(link: Link, pattern: str, n: int) -> str:
    """How a `pattern` over a group of `n` ranks on `link` is priced, in words for the breakdown,
    e.g. "p2p, slowest hop ib 45 GB/s per GPU" (achieved bandwidths: the catalog's times the
    efficiency model's fractions)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r} is not one of {PATTERNS}")
    return link.describe(pattern, n)


def _placed_model(link: Link, pattern: str, n: int) -> str:
    if link.kind != "ib":
        return f"{pattern}, nvlink {_gbs(link.bandwidth)} per GPU"
    if pattern == "p2p":
        return f"p2p, slowest hop ib {_gbs(link.p2p_bandwidth)} per GPU"
    if pattern == "collective":
        return (
            f"collective, NCCL rings over ib on {link.per_node} NIC(s) per node, "
            f"{_gbs(link.bandwidth)} per GPU"
        )
    k = min(link.per_node, n)
    if pattern == "dispatch":
        return (
            f"dispatch, one copy per remote node over ib {_gbs(link.ib_bandwidth)} per GPU, "
            f"nvlink {_gbs(link.nvlink_bandwidth)} inside"
        )
    return (
        f"all-to-all, {n - k}/{n} off node over ib {_gbs(link.ib_bandwidth)} per GPU, "
        f"nvlink {_gbs(link.nvlink_bandwidth)} inside"
    )
