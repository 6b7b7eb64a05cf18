"""Pipeline schedules as per-rank action lists, and an event simulation of them.

A schedule is what each pipeline rank computes, in order: `Action(kind, microbatch, chunk)` with
kind "F" (forward), "B" (backward; with `split_backward` only the input gradient) and "W" (weight
gradient, only when `split_backward`). `chunk` is the virtual stage index along the model,
0..pp*vpp-1; which rank holds a chunk depends on the schedule (`fivefold.spec.geometry`).

Schedules (written from the papers, not from a library; the runtime maps them onto
`torch.distributed.pipelining` where it can, so this module knows nothing about costs):
- "gpipe" (Huang et al. 2019): every forward, then every backward, in micro-batch order.
- "1f1b" (PipeDream-Flush, Narayanan et al. 2021): rank i runs p-1-i warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards.
- "interleaved-1f1b" (Narayanan et al. 2021, sec. 2.2): v chunks per rank, chunk c on rank c % p.
  Forwards go through the local chunks in rounds of p micro-batches (depth-first), backwards in the
  reverse chunk order; rank i warms up with (v-1)*p + 2*(p-1-i) forwards. Needs m % p == 0.
- "zbv" (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 6, the V schedule): two chunks
  per rank in a V (rank i holds chunks i and 2p-1-i), backward split into B (input gradient) and
  W (weight gradient); W fills the bubbles. Warm-up 2(p-i)-1 forwards of the first chunk, i
  forward pairs, p-i (F, B, W) triples on the second chunk, a steady F-B-W on both chunks, then a
  drain that defers W. Needs m >= 2p-1.
- "dualpipev" (DeepSeek-V3 report 2024, the "V" variant of DualPipe as
  `torch.distributed.pipelining.ScheduleDualPipeV` names it): the same V placement, eight phases
  (forwards of the first chunk, paired forwards, zero-bubble B/W on the second chunk, the main
  phase of overlapped forward-of-one/backward-of-another pairs, and a drain that switches to split
  backwards halfway). Needs m >= 2p. Simplifications: an overlapped (F, B) pair is two actions run
  back to back (the overlap hides expert all-to-all communication, not compute, so compute time
  is the same); a full (unsplit) backward is written "B" immediately followed by "W" of the same
  micro-batch and chunk.

Simulation (`simulate`): each rank executes its list in order; an action starts when the rank is
free and its dependencies are done: F(mb, c) needs F(mb, c-1); B(mb, c) needs F(mb, c) and
B(mb, c+1) (the last chunk's B needs only its F); W(mb, c) needs B(mb, c). A dependency on another
rank adds the point-to-point time `p2p_s`. Results: step time, bubble fraction (1 - mean busy /
step time), busy time and peak in-flight micro-batch activations per rank, and the timeline.
Peak in-flight counts, per rank, the (micro-batch, chunk) activations alive at once: one is taken
when a forward starts and released when its backward ends (with `split_backward`, when its W
ends, since W still needs the stored layer inputs). It is in units of one chunk's activations for
one micro-batch (a chunk is 1/v of a rank's layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple

from fivefold.errors import ConfigError
from fivefold.spec.geometry import SCHEDULES, V_SHAPED, ScheduleName, chunk_rank, chunks_of_rank

KINDS = ("F", "B", "W")
_F, _B, _W = 0, 1, 2


class Action(NamedTuple):
    """One unit of work on a pipeline rank: kind "F" | "B" | "W" of `microbatch` on `chunk`."""

    kind: str
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for `microbatches` micro-batches through `pp * vpp` chunks.

    `actions[r]` is the ordered tuple of `Action`s pipeline rank r executes (built on first use,
    so a schedule with thousands of micro-batches costs nothing until someone reads it). When
    `split_backward` is False, "B" is the full backward and there is no "W".
    """

    name: str
    pp: int
    vpp: int
    microbatches: int
    split_backward: bool

    @cached_property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        builder = _BUILDERS[self.name]
        return tuple(
            tuple(builder(self.pp, self.vpp, self.microbatches, r)) for r in range(self.pp)
        )

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank that holds virtual stage `chunk`."""
        return chunk_rank(self.name, self.pp, chunk)

    @property
    def peak_inflight(self) -> list[int]:
        """Per rank, the most (micro-batch, chunk) activations alive at once (cost-independent)."""
        return list(_peak_inflight(self))


# ---- building ------------------------------------------------------------------------------
def build_schedule(name: str, pp: int, vpp: int = 1, microbatches: int = 1) -> Schedule:
    """The action lists of schedule `name` for `pp` ranks, `vpp` chunks per rank, m micro-batches.

    Raises `ConfigError` naming the field and the fix when the combination cannot be built.
    Results are cached (schedules are immutable).
    """
    _check(name, pp, vpp, microbatches)
    return _build_cached(name, pp, vpp, microbatches)


def _check(name: str, pp: int, vpp: int, m: int) -> None:
    problems = []
    if name not in SCHEDULES:
        problems.append(f"schedule = {name!r}: choose one of {', '.join(SCHEDULES)}.")
    for label, value in (("pp", pp), ("vpp", vpp), ("microbatches (grad_accum)", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{label} = {value!r}: must be a whole number >= 1.")
    if problems:
        raise ConfigError(problems)
    if name in (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B) and vpp != 1:
        problems.append(f"schedule {name!r} has one chunk per rank: set vpp = 1 (got {vpp}).")
    if name == ScheduleName.INTERLEAVED_1F1B:
        if vpp < 2:
            problems.append(f"schedule 'interleaved-1f1b' needs vpp >= 2 (got {vpp}).")
        if m % pp:
            problems.append(
                f"microbatches (grad_accum) = {m} must be a multiple of pp = {pp} for "
                "'interleaved-1f1b' (micro-batches go through the chunks in rounds of pp)."
            )
    if name in V_SHAPED:
        if vpp != 2:
            problems.append(f"schedule {name!r} is V-shaped: set vpp = 2 (got {vpp}).")
        least = 2 * pp - 1 if name == ScheduleName.ZBV else 2 * pp
        if m < least:
            problems.append(
                f"microbatches (grad_accum) = {m}: {name} with pp = {pp} needs at least {least}; "
                f"raise grad_accum or lower pp."
            )
    if problems:
        raise ConfigError(problems)


@lru_cache(maxsize=4096)
def _build_cached(name: str, pp: int, vpp: int, m: int) -> Schedule:
    return Schedule(name, pp, vpp, m, split_backward=name in V_SHAPED)


def _gpipe_rank(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    return [Action("F", k, rank) for k in range(m)] + [Action("B", k, rank) for k in range(m)]


def _one_f_one_b_rank(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    warmup = min(pp - 1 - rank, m)
    out = [Action("F", k, rank) for k in range(warmup)]
    for k in range(m - warmup):
        out += [Action("F", warmup + k, rank), Action("B", k, rank)]
    return out + [Action("B", k, rank) for k in range(m - warmup, m)]


def _interleaved_rank(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    total = m * vpp  # (micro-batch, local chunk) units, in Megatron's order

    def unit(k: int, backward: bool) -> tuple[int, int]:
        local = (k // pp) % vpp
        if backward:
            local = vpp - 1 - local
        microbatch = (k // (pp * vpp)) * pp + k % pp
        return microbatch, local * pp + rank

    warmup = min((vpp - 1) * pp + 2 * (pp - 1 - rank), total)
    out = [Action("F", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        out += [Action("F", *unit(warmup + k, False)), Action("B", *unit(k, True))]
    return out + [Action("B", *unit(k, True)) for k in range(total - warmup, total)]


class _VBuilder:
    """Appends actions for the two chunks of one rank of a V schedule, counting micro-batches."""

    def __init__(self, name: str, pp: int, rank: int):
        self.chunks = chunks_of_rank(name, pp, 2, rank)
        self.next = {(kind, side): 0 for kind in KINDS for side in (0, 1)}
        self.pending_w: list[tuple[int, int]] = []  # (side, microbatch) with B done, W not yet
        self.out: list[Action] = []

    def _emit(self, kind: str, side: int, microbatch: int | None = None) -> None:
        if microbatch is None:
            microbatch = self.next[(kind, side)]
            self.next[(kind, side)] += 1
        self.out.append(Action(kind, microbatch, self.chunks[side]))

    def forward(self, side: int) -> None:
        self._emit("F", side)

    def backward_input(self, side: int) -> None:
        """B alone; its W is queued for later."""
        self.pending_w.append((side, self.next[("B", side)]))
        self._emit("B", side)

    def backward_full(self, side: int) -> None:
        """An unsplit backward, written as B then W of the same micro-batch."""
        microbatch = self.next[("B", side)]
        self._emit("B", side)
        self._emit("W", side, microbatch)

    def weight(self) -> None:
        """The oldest deferred W, if any."""
        if self.pending_w:
            side, microbatch = self.pending_w.pop(0)
            self._emit("W", side, microbatch)

    def weight_of(self, side: int) -> None:
        """The oldest deferred W of chunk `side`."""
        for i, (s, microbatch) in enumerate(self.pending_w):
            if s == side:
                del self.pending_w[i]
                self._emit("W", side, microbatch)
                return


def _zbv_rank(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    v = _VBuilder(ScheduleName.ZBV, pp, rank)
    for _ in range(2 * (pp - rank) - 1):
        v.forward(0)
    for _ in range(rank):
        v.forward(1)
        v.forward(0)
    for _ in range(pp - rank):
        v.forward(1)
        v.backward_input(1)
        v.weight_of(1)
    while v.next[("F", 0)] < m or v.next[("F", 1)] < v.next[("F", 0)]:
        if v.next[("F", 0)] < m:
            v.forward(0)
        v.backward_input(0)
        v.weight_of(0)
        v.forward(1)
        v.backward_input(1)
        v.weight_of(1)
    for _ in range(rank):
        v.backward_input(0)
        v.backward_input(1)
    for _ in range(pp - rank):
        v.backward_input(0)
        v.weight_of(0)
    while any(side == 1 for side, _ in v.pending_w):
        v.weight_of(1)
    while v.pending_w:
        v.weight_of(0)
    return v.out


def _dualpipev_rank(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    v = _VBuilder(ScheduleName.DUALPIPEV, pp, rank)
    for _ in range(2 * (pp - rank - 1)):  # 1: forwards of the first chunk
        v.forward(0)
    for _ in range(rank + 1):  # 2: paired forwards
        v.forward(0)
        v.forward(1)
    for _ in range(pp - rank - 1):  # 3: zero-bubble B/W on the second chunk
        v.backward_input(1)
        v.weight()
        v.forward(1)
    for _ in range(m - 2 * pp + rank + 1):  # 4: main phase, (F0, B1) and (F1, B0) pairs
        v.forward(0)
        v.backward_full(1)
        v.forward(1)
        v.backward_full(0)
    for _ in range(pp - rank - 1):  # 5: B1, then the (F1, B0) pair
        v.backward_full(1)
        v.forward(1)
        v.backward_full(0)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):  # 6: B1 B0, split backwards from the middle on
        if i == half and rank % 2 == 1:
            split = True
        (v.backward_input if split else v.backward_full)(1)
        if i == half and rank % 2 == 0:
            split = True
        (v.backward_input if split else v.backward_full)(0)
    for _ in range(pp - rank - 1):  # 7: deferred W, then B0
        v.weight()
        (v.backward_input if split else v.backward_full)(0)
    while v.pending_w:  # 8: the remaining W
        v.weight()
    return v.out


_BUILDERS = {
    ScheduleName.GPIPE: _gpipe_rank,
    ScheduleName.ONE_F_ONE_B: _one_f_one_b_rank,
    ScheduleName.INTERLEAVED_1F1B: _interleaved_rank,
    ScheduleName.ZBV: _zbv_rank,
    ScheduleName.DUALPIPEV: _dualpipev_rank,
}


# ---- dependencies (cost-independent, cached with the schedule) -------------------------------
# An action's integer id: (kind * chunks + chunk) * microbatches + microbatch.
_Op = tuple[int, int, int, int, bool, bool]  # id, kind*chunks+chunk, dep_a, dep_b, cross_a, cross_b


@lru_cache(maxsize=256)
def _integer_ops(schedule: Schedule) -> tuple[tuple[_Op, ...], ...]:
    """Per rank, each action as integers: its id, its duration slot and its dependencies."""
    m, chunks = schedule.microbatches, schedule.num_chunks
    rank_of = [schedule.rank_of(c) for c in range(chunks)]
    kind_index = {"F": _F, "B": _B, "W": _W}
    b_base = chunks * m  # id offset of the B actions; W's is twice that
    out = []
    for rank, actions in enumerate(schedule.actions):
        ops = []
        append = ops.append
        for kind_name, mb, c in actions:
            kind = kind_index[kind_name]
            own = c * m + mb  # this (chunk, micro-batch)'s F id
            if kind == _F:
                if c > 0:
                    append((own, c, own - m, -1, rank_of[c - 1] != rank, False))
                else:
                    append((own, c, -1, -1, False, False))
            elif kind == _B:
                if c < chunks - 1:
                    dep_b = b_base + own + m
                    append((b_base + own, chunks + c, own, dep_b, False, rank_of[c + 1] != rank))
                else:
                    append((b_base + own, chunks + c, own, -1, False, False))
            else:
                append((2 * b_base + own, 2 * chunks + c, b_base + own, -1, False, False))
        out.append(tuple(ops))
    return tuple(out)


@lru_cache(maxsize=4096)
def _peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Peak in-flight (micro-batch, chunk) activations per rank, in closed form.

    GPipe m; 1F1B min(p - i, m); interleaved its warm-up plus one, min((v-1)p + 2(p-1-i) + 1,
    m v); ZBV 2p on every rank; DualPipeV 2p + 1. Tests check each against the action lists
    (`peak_inflight_from_actions`) for every valid p <= 9, m < 50.
    """
    p, m, v = schedule.pp, schedule.microbatches, schedule.vpp
    name = schedule.name
    if name == ScheduleName.GPIPE:
        return (m,) * p
    if name == ScheduleName.ONE_F_ONE_B:
        return tuple(min(p - i, m) for i in range(p))
    if name == ScheduleName.INTERLEAVED_1F1B:
        return tuple(min((v - 1) * p + 2 * (p - 1 - i) + 1, m * v) for i in range(p))
    if name == ScheduleName.ZBV:
        return (2 * p,) * p
    return (2 * p + 1,) * p


def peak_inflight_from_actions(schedule: Schedule) -> tuple[int, ...]:
    """Peak in-flight activations per rank, counted along the action lists (the reference)."""
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for actions in schedule.actions:
        alive = peak = 0
        for a in actions:
            if a.kind == "F":
                alive += 1
                peak = max(peak, alive)
            elif a.kind == release:
                alive -= 1
        peaks.append(peak)
    return tuple(peaks)


# ---- simulation ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch for each virtual stage (chunk) along the model, and the p2p time.

    Lists are stored as tuples (so costs can key a cache). With an unsplit backward, a "B" lasts
    backward_input_s + backward_weight_s.
    """

    forward_s: tuple[float, ...]
    backward_input_s: tuple[float, ...]
    backward_weight_s: tuple[float, ...]
    p2p_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        n = len(self.forward_s)
        if len(self.backward_input_s) != n or len(self.backward_weight_s) != n:
            raise ConfigError(
                "StageCosts: forward_s, backward_input_s and backward_weight_s need one entry per "
                f"virtual stage (got {n}, {len(self.backward_input_s)}, "
                f"{len(self.backward_weight_s)})."
            )
        if min((*self.forward_s, *self.backward_input_s, *self.backward_weight_s), default=0) < 0:
            raise ConfigError("StageCosts: stage times must be >= 0 seconds.")
        if self.p2p_s < 0:
            raise ConfigError(f"StageCosts.p2p_s = {self.p2p_s}: must be >= 0 seconds.")

    @classmethod
    def uniform(
        cls,
        chunks: int,
        forward_s: float,
        backward_input_s: float,
        backward_weight_s: float = 0.0,
        p2p_s: float = 0.0,
    ) -> StageCosts:
        """The same times for every one of `chunks` virtual stages."""
        return cls(
            (forward_s,) * chunks,
            (backward_input_s,) * chunks,
            (backward_weight_s,) * chunks,
            p2p_s,
        )


@dataclass(frozen=True)
class Event:
    kind: str
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """Outcome of running a schedule: times in seconds, per-rank tuples indexed by pipeline rank.

    `extrapolated` is True when the step time came from the steady state of shorter runs (see
    `simulate`); `events` is then computed on first access by a full run.
    """

    step_time_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    schedule: Schedule = field(repr=False)
    costs: StageCosts = field(repr=False)
    extrapolated: bool = False

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time relative to the ideal (busy) time: (step - mean busy) / mean busy."""
        mean_busy = sum(self.busy_s) / len(self.busy_s)
        return (self.step_time_s - mean_busy) / mean_busy if mean_busy else 0.0

    @cached_property
    def events(self) -> list[list[Event]]:
        """Per rank, every action with its start and end time, in execution order."""
        start, finish = _run(self.schedule, self.costs)
        chunks, m = self.schedule.num_chunks, self.schedule.microbatches
        out = []
        for actions in self.schedule.actions:
            row = []
            for a in actions:
                ident = (KINDS.index(a.kind) * chunks + a.chunk) * m + a.microbatch
                row.append(Event(a.kind, a.microbatch, a.chunk, start[ident], finish[ident]))
            out.append(row)
        return out


class ScheduleDeadlock(RuntimeError):
    """Internal: an action list waits on work that can never happen (a bug in a builder)."""


# Above this many actions (about 15 ms of simulation) the step time is extrapolated.
EXACT_ACTION_LIMIT = 16384


def simulate(schedule: Schedule, costs: StageCosts) -> Simulation:
    """Run every rank's action list in order against `costs`; see the module docstring.

    Long schedules (more than `EXACT_ACTION_LIMIT` actions) are not run in full: once the
    pipeline is in its steady state the step time grows by a fixed amount per pp micro-batches,
    so it is extrapolated linearly from two runs of k*pp and (k+1)*pp micro-batches that together
    stay within the limit. With uniform stages this is exact; with unbalanced stages the steady
    state can take many micro-batches to settle (a slow stage's queue fills up) or repeat with a
    longer period, and the error is what remains of that transient (tests bound it). Busy time
    and peak in-flight are exact either way. Results are cached.
    """
    if len(costs.forward_s) != schedule.num_chunks:
        raise ConfigError(
            f"StageCosts has {len(costs.forward_s)} stages but schedule {schedule.name!r} has "
            f"pp * vpp = {schedule.num_chunks} chunks; give one cost per chunk."
        )
    return _simulate_cached(schedule, costs)


def _extrapolation_microbatches(schedule: Schedule) -> int:
    """The shorter run: a multiple of pp, at least 4*pp, both runs within the limit if possible."""
    per_microbatch = _action_count(schedule) // schedule.microbatches
    budget = EXACT_ACTION_LIMIT // (2 * per_microbatch)
    return schedule.pp * max(4, budget // schedule.pp - 1)


def _action_count(schedule: Schedule) -> int:
    per_unit = 3 if schedule.split_backward else 2
    return per_unit * schedule.microbatches * schedule.num_chunks


@lru_cache(maxsize=8192)
def _simulate_cached(schedule: Schedule, costs: StageCosts) -> Simulation:
    m = schedule.microbatches
    short = _extrapolation_microbatches(schedule)
    # When the shorter run is already m micro-batches, extrapolating gives the exact run's
    # step (at twice its cost): run it exactly instead.
    extrapolate = _action_count(schedule) > EXACT_ACTION_LIMIT and short < m
    if extrapolate:
        first = _build_cached(schedule.name, schedule.pp, schedule.vpp, short)
        second = _build_cached(schedule.name, schedule.pp, schedule.vpp, short + schedule.pp)
        t1 = max(_run(first, costs)[1])
        t2 = max(_run(second, costs)[1])
        step = t1 + (t2 - t1) * (m - short) / schedule.pp
    else:
        step = max(_run(schedule, costs)[1], default=0.0)
    busy = _busy_per_rank(schedule, costs)
    bubble = 1.0 - (sum(busy) / schedule.pp) / step if step > 0 else 0.0
    return Simulation(
        step_time_s=step,
        bubble_fraction=bubble,
        busy_s=busy,
        peak_inflight=_peak_inflight(schedule),
        schedule=schedule,
        costs=costs,
        extrapolated=extrapolate,
    )


def _busy_per_rank(schedule: Schedule, costs: StageCosts) -> tuple[float, ...]:
    """m times the sum of a rank's chunk times (every action runs once per micro-batch)."""
    per_chunk = [
        f + b + w
        for f, b, w in zip(
            costs.forward_s, costs.backward_input_s, costs.backward_weight_s, strict=True
        )
    ]
    busy = [0.0] * schedule.pp
    for chunk, t in enumerate(per_chunk):
        busy[schedule.rank_of(chunk)] += t * schedule.microbatches
    return tuple(busy)


def _run(schedule: Schedule, costs: StageCosts) -> tuple[list[float], list[float]]:
    """Start and finish time of every action id; raises ScheduleDeadlock if the lists block."""
    rank_ops = _integer_ops(schedule)
    chunks = schedule.num_chunks
    if schedule.split_backward:
        backward = costs.backward_input_s
    else:
        backward = tuple(
            b + w for b, w in zip(costs.backward_input_s, costs.backward_weight_s, strict=True)
        )
    duration = (*costs.forward_s, *backward, *costs.backward_weight_s)
    assert len(duration) == 3 * chunks
    p2p = costs.p2p_s
    size = 3 * chunks * schedule.microbatches
    start_at = [0.0] * size
    finish = [-1.0] * size
    waiting: dict[int, int] = {}  # action id -> the rank blocked on it
    pp = schedule.pp
    position = [0] * pp
    free_at = [0.0] * pp
    ready = list(range(pp - 1, -1, -1))
    while ready:
        rank = ready.pop()
        ops = rank_ops[rank]
        i, t = position[rank], free_at[rank]
        n = len(ops)
        while i < n:
            me, slot, dep_a, dep_b, cross_a, cross_b = ops[i]
            begin = t
            if dep_a >= 0:
                done = finish[dep_a]
                if done < 0:
                    waiting[dep_a] = rank
                    break
                if cross_a:
                    done += p2p
                if done > begin:
                    begin = done
            if dep_b >= 0:
                done = finish[dep_b]
                if done < 0:
                    waiting[dep_b] = rank
                    break
                if cross_b:
                    done += p2p
                if done > begin:
                    begin = done
            t = begin + duration[slot]
            start_at[me] = begin
            finish[me] = t
            i += 1
            if waiting:
                woken = waiting.pop(me, None)
                if woken is not None:
                    ready.append(woken)
        position[rank], free_at[rank] = i, t
    for r in range(pp):
        if position[r] < len(rank_ops[r]):
            raise ScheduleDeadlock(
                f"{schedule.name} pp={pp} vpp={schedule.vpp} m={schedule.microbatches}: rank {r} "
                f"blocks at {schedule.actions[r][position[r]]}"
            )
    return start_at, finish


def closed_form_bubble(pp: int, microbatches: int, vpp: int = 1) -> float:
    """Bubble fraction of step time for GPipe/1F1B (vpp = 1) and interleaved 1F1B, uniform stages.

    Idle time relative to ideal is (p-1)/(v*m) (Narayanan et al. 2021); as a fraction of the step
    that is (p-1) / (v*m + p - 1), which is (p-1)/(m+p-1) for v = 1.
    """
    return (pp - 1) / (vpp * microbatches + pp - 1)
