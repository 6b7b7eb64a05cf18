"""A collective's time at any message size from the sizes `fivefold calibrate` measured
(`CollectiveSample` rows): piecewise linear in log(size) / log(time) between the measured sizes,
beyond the largest its time plus the rest at the fitted line's bandwidth (beta), below the
smallest its time (the latency floor); linear in the compute gap between the two measured gaps
around it.

One alpha + size / beta line through every size misprices both ends on a CPU: gloo's bandwidth
at 16 MiB is not its bandwidth at 1 MiB, and a line fitted through both lifts alpha by
milliseconds for the small messages (docs/device-profile.md)."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import TypeVar

from fivefold.specs.profile import Collective, CollectiveSample

Row = TypeVar("Row", Collective, CollectiveSample)


def sampled_time_s(
    samples: tuple[CollectiveSample, ...],
    op: str,
    n: int,
    world: int,
    size_bytes: float,
    gap_s: float | None,
    beta: float,
) -> float | None:
    """Seconds of one `op` of `size_bytes` over `n` ranks among `world` local processes,
    issued after `gap_s` seconds of compute (None: the longest gap measured), from the samples
    of the nearest measured (ranks, world) as `MeasuredRates.collective` picks them; None where
    that group size was not measured or fewer than two sizes were at a gap (then the fitted
    line prices it). `beta`: the fitted bandwidth (bytes/s) beyond the largest size."""
    group = nearest_samples(samples, op, n, world)
    if not group or group[0].ranks != n:
        return None
    by_gap: dict[float, list[CollectiveSample]] = {}
    for s in group:
        by_gap.setdefault(s.gap_s, []).append(s)
    curves = [(gap, _curve(at_gap)) for gap, at_gap in sorted(by_gap.items())]
    if any(len(curve) < 2 for _, curve in curves):
        return None
    times = [(gap, _at(curve, size_bytes, beta)) for gap, curve in curves]
    gap_s = times[-1][0] if gap_s is None else gap_s
    if gap_s <= times[0][0]:
        return times[0][1]
    for (lo_gap, lo), (hi_gap, hi) in itertools.pairwise(times):
        if gap_s < hi_gap:
            w = (gap_s - lo_gap) / (hi_gap - lo_gap)
            return lo + w * (hi - lo)
    return times[-1][1]


def nearest_group(rows: list[Row], n: int, world: int) -> Row:
    """The measured row (a `Collective` or `CollectiveSample`) nearest a group of `n` ranks
    among `world` local processes: the nearest group size, then the nearest process count,
    then the larger group."""
    return min(rows, key=lambda r: (abs(r.ranks - n), abs(r.world - world), -r.ranks))


def nearest_samples(
    samples: tuple[CollectiveSample, ...], op: str, n: int, world: int
) -> list[CollectiveSample]:
    """The samples of `op` measured on the group `nearest_group` picks for `n` ranks among
    `world` local processes (empty when `op` was not measured)."""
    mine = [s for s in samples if s.op == op]
    if not mine:
        return []
    near = nearest_group(mine, n, world)
    return [s for s in mine if (s.ranks, s.world) == (near.ranks, near.world)]


def _curve(rows: list[CollectiveSample]) -> list[tuple[float, float]]:
    """(size, time) ascending in size, the median time of repeated sizes."""
    sizes: dict[int, list[float]] = {}
    for r in rows:
        sizes.setdefault(r.size_bytes, []).append(r.time_s)
    return [(float(s), sorted(t)[len(t) // 2]) for s, t in sorted(sizes.items())]


def _at(curve: list[tuple[float, float]], size: float, beta: float) -> float:
    """Seconds at `size` on one gap's (size, time) curve (module docstring)."""
    first_size, first_time = curve[0]
    last_size, last_time = curve[-1]
    if size <= first_size:
        return first_time
    if size >= last_size:
        return last_time + (size - last_size) / beta
    i = bisect.bisect_right([s for s, _ in curve], size)
    (s0, t0), (s1, t1) = curve[i - 1], curve[i]
    w = math.log(size / s0) / math.log(s1 / s0)
    return math.exp(math.log(t0) + w * math.log(t1 / t0))
