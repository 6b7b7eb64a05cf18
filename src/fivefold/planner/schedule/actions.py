"""Pipeline schedules as per-rank action lists: `Action(kind, microbatch, chunk)` with kind "F"
(forward), "B" (backward; with `split_backward` only the input gradient) and "W" (weight
gradient), chunk the virtual stage along the model. gpipe, 1f1b, interleaved-1f1b, zbv and
dualpipev, written from their papers; the rules, and the simulation that runs them
(`planner/schedule/simulation.py`), are in docs/planner.md, "Pipeline schedules".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

from fivefold.errors import ConfigError
from fivefold.specs.geometry import (
    SCHEDULES,
    V_SHAPED,
    ScheduleName,
    chunk_rank,
    chunks_of_rank,
    schedule_problems,
)

KINDS = ("F", "B", "W")


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
    problems = schedule_problems(name, pp, vpp, m)
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
