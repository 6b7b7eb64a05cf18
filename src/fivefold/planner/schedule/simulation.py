"""Running a pipeline schedule against per-stage costs: the event simulation (`simulate`: step
time, busy time, bubble and timeline per rank) and the closed forms (`analytic_pipeline`,
`closed_form_bubble`). The rules are in docs/planner.md, "Pipeline schedules".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from fivefold.errors import ConfigError
from fivefold.planner.schedule.actions import KINDS, Schedule, build_schedule
from fivefold.specs.geometry import ONE_CHUNK_PER_RANK, chunk_rank
from fivefold.specs.plan import ParallelPlan

_F, _B, _W = 0, 1, 2

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
        first = build_schedule(schedule.name, schedule.pp, schedule.vpp, short)
        second = build_schedule(schedule.name, schedule.pp, schedule.vpp, short + schedule.pp)
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
        peak_inflight=tuple(schedule.peak_inflight),
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


def analytic_pipeline(plan: ParallelPlan, costs: StageCosts) -> tuple[float, list[float]]:
    """(step seconds, busy seconds per rank) of the pipeline from closed forms.

    With T_r the per-micro-batch work of rank r (F + B + W over its chunks), m micro-batches,
    p ranks, v chunks per rank and the point-to-point time d:
      GPipe, 1F1B:       (m - 1) max T_r + sum_r T_r + 2 (p - 1) d   (uniform: (m + p - 1) T)
      interleaved 1F1B:  m max T_r + (p - 1) mean T_r / v + 2 (p v - 1) d
                         (uniform: ideal * (1 + (p - 1)/(v m)), Narayanan et al. 2021)
      ZBV, DualPipeV:    m max T_r + (p - 1) max(0, F + B - 2 W) + 2 (2p - 1) d, with F, B, W the
                         mean chunk times (the zero-bubble V schedule's bubble, Qi et al. 2024)
    """
    m, p, v = plan.grad_accum, plan.pp, plan.vpp
    work = [0.0] * p
    for chunk in range(p * v):
        rank = chunk_rank(plan.schedule, plan.pp, chunk)
        work[rank] += (
            costs.forward_s[chunk] + costs.backward_input_s[chunk] + costs.backward_weight_s[chunk]
        )
    busy = [m * w for w in work]
    d = costs.p2p_s
    if plan.schedule in ONE_CHUNK_PER_RANK:
        return (m - 1) * max(work) + sum(work) + 2 * (p - 1) * d, busy
    if plan.schedule == "interleaved-1f1b":
        mean = sum(work) / p
        return m * max(work) + (p - 1) * mean / v + 2 * (p * v - 1) * d, busy
    n = p * v
    f = sum(costs.forward_s) / n
    b = sum(costs.backward_input_s) / n
    w = sum(costs.backward_weight_s) / n
    return m * max(work) + (p - 1) * max(0.0, f + b - 2 * w) + 2 * (n - 1) * d, busy
