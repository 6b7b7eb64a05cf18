"""The layout's geometry: mesh axes and their order, rank coordinates, process groups, shard
degrees, which pipeline rank holds which chunk, and the names of a plan's choices.

Pure Python (no torch), read by the plan's validation, the planner, the runtime's mesh, the
explorer's rank grid and the CLI. Degrees come from any object with the fields pp,
dp_replicate, dp_shard, cp, tp and ep (a `ParallelPlan`, the runtime's `ParallelDims`).

Mesh axes, outer to inner: pp, dp_replicate, dp_shard, cp, tp (TP innermost, so a TP group is a
run of consecutive ranks and stays inside a node); rank r has row-major coordinates in that
order. A process group is `size` ranks `stride` apart (`axis_groups`): the five axes and the
flattened views the runtime builds, dp = dp_replicate x dp_shard, dp_shard_cp = dp_shard x cp
(what ZeRO shards dense weights over), dp_cp = dp x cp, dp_cp_tp = dp x cp x tp (every rank of
a pipeline stage), ep and expert_shard (below).

The expert rule (docs/internals.md, "MoE with tensor parallelism"): routed experts are never
tensor-parallel. A MoE layer's tokens are split over the TP ranks (the sequence-parallel shards),
so every rank of dp_shard x cp x tp routes different tokens; expert parallelism borrows its ep
ranks there, innermost first (ep must divide dp_shard x cp x tp: with TP the EP group holds the
TP group, consecutive ranks in one node), and ZeRO shards each routed expert over the rest,
expert_shard = dp_shard x cp x tp / ep. With tp = 1 this is the rule of dp_shard x cp alone.
A plan may instead describe Megatron's expert tensor parallelism (plan.etp = tp, which other
software's published runs use; fivefold's runtime refuses it): experts split over the TP group,
every TP rank dispatching the same tokens, EP over dp_shard x cp (tp apart).

Chunk placement: a pipeline of pp ranks runs pp * vpp chunks (virtual stages, in model order).
The loop schedules put chunk c on rank c % pp; the V-shaped ones (two chunks per rank) put rank
i's chunks at i and 2 pp - 1 - i, so the first and the last chunk share rank 0.
"""

from __future__ import annotations

from enum import StrEnum
from functools import lru_cache
from typing import Protocol


class ScheduleName(StrEnum):
    """Pipeline schedules (`fivefold.planner.schedule.actions` builds their action lists)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


class CpKind(StrEnum):
    """How context-parallel ranks exchange keys and values."""

    RING = "ring"
    ALLGATHER = "allgather"
    ULYSSES = "ulysses"


class Recompute(StrEnum):
    """Activation recompute policies, cheapest first (each recomputes more)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Offload(StrEnum):
    """What lives in host memory: nothing, the optimizer (ZeRO-Offload), or also the sharded
    parameters and gradients (FSDP2's CPUOffloadPolicy; needs zero = 3)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    ALL = "all"


# The values as plain strings, in order: for messages, TOML / JSON and argparse choices.
SCHEDULES: tuple[str, ...] = tuple(s.value for s in ScheduleName)
CP_KINDS: tuple[str, ...] = tuple(k.value for k in CpKind)
RECOMPUTE_POLICIES: tuple[str, ...] = tuple(r.value for r in Recompute)
OFFLOAD_KINDS: tuple[str, ...] = tuple(o.value for o in Offload)

V_SHAPED = (ScheduleName.ZBV, ScheduleName.DUALPIPEV)  # exactly two chunks per rank, in a V
ONE_CHUNK_PER_RANK = (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B)


class Axis(StrEnum):
    """The mesh axes, declared outer to inner."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


MESH_ORDER: tuple[Axis, ...] = tuple(Axis)  # outer to inner: tp varies fastest with the rank


class Degrees(Protocol):
    """The parallel degrees of a layout (`ParallelPlan`, `ParallelDims`)."""

    @property
    def pp(self) -> int: ...
    @property
    def dp_replicate(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def ep(self) -> int: ...


# ---- ranks and groups --------------------------------------------------------------------------
def mesh_shape(d: Degrees) -> tuple[int, ...]:
    """The degrees in `MESH_ORDER`."""
    return tuple(getattr(d, axis) for axis in MESH_ORDER)


def mesh_size(d: Degrees) -> int:
    """Ranks in the mesh: pp x dp_replicate x dp_shard x cp x tp."""
    return d.pp * d.dp_replicate * d.dp_shard * d.cp * d.tp


def rank_coordinates(d: Degrees, rank: int) -> dict[str, int]:
    """Row-major coordinates of `rank` on the mesh axes, in `MESH_ORDER` (tp innermost)."""
    if not 0 <= rank < mesh_size(d):
        raise ValueError(f"rank {rank} outside a world of {mesh_size(d)}")
    out: dict[str, int] = {}
    rest = rank
    for axis in reversed(MESH_ORDER):
        size = getattr(d, axis)
        out[axis.value] = rest % size
        rest //= size
    return {axis.value: out[axis.value] for axis in MESH_ORDER}


def dense_shard_degree(d: Degrees) -> int:
    """Ranks ZeRO shards dense weights over: dp_shard x cp (the runtime's dp_shard_cp)."""
    return d.dp_shard * d.cp


def expert_span(d: Degrees) -> int:
    """Ranks of one replica that route different tokens, which expert parallelism borrows:
    dp_shard x cp x tp (a MoE layer's tokens are split over the TP ranks; x 1 under etp)."""
    return d.dp_shard * d.cp * moe_token_split(d)


def expert_tp(d: Degrees) -> int:
    """TP ranks each routed expert is split over: 1 (whole experts), or tp under `plan.etp`."""
    return getattr(d, "etp", 1)


def rank_tokens(micro_batch: int, seq_len: int, d: Degrees) -> float:
    """Token rows of one micro-batch that one rank's layers process: b s/cp."""
    return micro_batch * seq_len / d.cp


def sequence_shard_divisor(sp: bool, d: Degrees) -> int:
    """How many ways sequence parallelism splits the norm region's rows: tp under SP, else 1."""
    return d.tp if sp and d.tp > 1 else 1


def moe_token_split(d: Degrees) -> int:
    """How many ranks share one micro-batch's tokens at a MoE layer, besides cp: the TP ranks
    (each routes its own 1/tp of them, to whole experts); 1 under expert tensor parallelism."""
    return d.tp // expert_tp(d)


def expert_shard_degree(d: Degrees) -> int:
    """Ranks ZeRO shards routed experts over: dp_shard x cp x tp / ep (the runtime's edp_shard)."""
    return max(1, expert_span(d) // d.ep)


def ep_fits(ep: int, dp_shard: int, cp: int, tp: int = 1) -> bool:
    """Whether `ep` divides dp_shard x cp x tp, the ranks expert parallelism borrows."""
    return (dp_shard * cp * tp) % ep == 0


def axis_groups(d: Degrees) -> dict[str, tuple[int, int]]:
    """(size, stride) of every process group: `size` ranks, `stride` apart in rank order."""
    tp, cp, dp = d.tp, d.cp, d.dp_replicate * d.dp_shard
    return {
        "tp": (tp, 1),
        "cp": (cp, tp),
        "ep": (d.ep, expert_tp(d)),  # the inner ep ranks of dp_shard x cp x tp
        "dp": (dp, tp * cp),
        "dp_shard_cp": (dense_shard_degree(d), tp),
        "dp_cp": (dp * cp, tp),
        "dp_cp_tp": (dp * cp * moe_token_split(d), expert_tp(d)),  # ranks routing own tokens
        "dp_replicate": (d.dp_replicate, tp * cp * d.dp_shard),
        "expert_shard": (expert_shard_degree(d), expert_tp(d) * d.ep),
        "pp": (d.pp, tp * cp * dp),
    }


def group_index(size: int, stride: int, rank: int) -> int:
    """Which group of `size` ranks `stride` apart holds `rank`: 0 .. groups-1, numbered in the
    order of each group's first rank."""
    return rank // (size * stride) * stride + rank % stride


# ---- schedules and chunk placement ---------------------------------------------------------------
def least_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step `schedule` runs on `pp` ranks: 2 pp - 1 for zbv (torch's
    ZBV builds its order for that many and fills fewer with idle slots), 2 pp for dualpipev
    (torch refuses fewer), pp for interleaved-1f1b (micro-batches go round the chunks in rounds
    of pp), 1 otherwise."""
    if schedule == ScheduleName.ZBV:
        return 2 * pp - 1
    if schedule == ScheduleName.DUALPIPEV:
        return 2 * pp
    return pp if schedule == ScheduleName.INTERLEAVED_1F1B else 1


def schedule_problems(schedule: str, pp: int, vpp: int, microbatches: int) -> list[str]:
    """Why `schedule` cannot run `vpp` chunks per rank on `pp` ranks with `microbatches`
    micro-batches per step (plan.grad_accum); empty when it can. The one rule for the plan, the
    planner's action lists and the runtime's torch schedule."""
    out = []
    m = microbatches
    if schedule in ONE_CHUNK_PER_RANK and vpp != 1:
        out.append(
            f"plan.schedule = {schedule!r} runs one stage per rank: set plan.vpp = 1, or use "
            "'interleaved-1f1b' for vpp > 1."
        )
    if schedule == ScheduleName.INTERLEAVED_1F1B:
        if vpp < 2:
            out.append("plan.schedule = 'interleaved-1f1b' needs plan.vpp >= 2.")
        if m % pp:
            out.append(
                f"plan.grad_accum = {m} (micro-batches) must be a multiple of plan.pp = {pp} for "
                "'interleaved-1f1b' (micro-batches go through the chunks in rounds of pp)."
            )
    if schedule in V_SHAPED:
        if vpp != 2:
            out.append(
                f"plan.schedule = {schedule!r} is V-shaped with exactly two stages per rank: set "
                f"plan.vpp = 2 (got {vpp})."
            )
        least = least_microbatches(schedule, pp)
        if m < least:
            out.append(
                f"plan.grad_accum = {m} (micro-batches): {schedule} with plan.pp = {pp} needs at "
                f"least {least}; raise plan.grad_accum or lower plan.pp."
            )
    return out


def is_v_shaped(schedule: str, pp: int) -> bool:
    """Whether a pipeline of `pp` ranks places its chunks in a V (zbv, dualpipev)."""
    return schedule in V_SHAPED and pp > 1


def chunk_rank(schedule: str, pp: int, chunk: int) -> int:
    """The pipeline rank holding virtual stage `chunk`: chunk % pp, or the V (chunk, then
    2 pp - 1 - chunk)."""
    if is_v_shaped(schedule, pp):
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


@lru_cache(maxsize=4096)
def chunks_of_rank(schedule: str, pp: int, vpp: int, rank: int) -> tuple[int, ...]:
    """The virtual stages pipeline rank `rank` holds, in model order."""
    return tuple(c for c in range(pp * vpp) if chunk_rank(schedule, pp, c) == rank)
