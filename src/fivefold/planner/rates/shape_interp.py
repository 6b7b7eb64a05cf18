"""Rates as functions of shape: log-space interpolation among measured shapes, and where a
shape lies beyond them (an extrapolation, which the prediction names)."""

from __future__ import annotations

import math

NEIGHBOURS = 4  # measured shapes a rate is interpolated from (`log_shape_interp`)


def log_shape_interp(
    shape: tuple[float, ...], points: list[tuple[tuple[float, ...], float]]
) -> float:
    """A positive value at `shape` from measured (shape, value) points: each coordinate first
    clamped into the points' range (beyond the measured shapes, the edge's values: see
    `beyond_range`), then the value of an equal shape, else exp of the mean log value of the
    `NEIGHBOURS` nearest points by Euclidean distance in log coordinates, weighted by
    1 / distance^2."""
    lows, highs = _ranges(shape, points)
    where = [math.log(min(max(x, lo), hi)) for x, lo, hi in zip(shape, lows, highs, strict=True)]
    near = []
    for point, value in points:
        d2 = sum((math.log(p) - w) ** 2 for p, w in zip(point, where, strict=True))
        if d2 < 1e-18:
            return value
        near.append((d2, value))
    near.sort()
    near = near[:NEIGHBOURS]
    weights = [1.0 / d2 for d2, _ in near]
    logs = sum(w * math.log(v) for w, (_, v) in zip(weights, near, strict=True))
    return math.exp(logs / sum(weights))


def beyond_range(
    shape: tuple[float, ...], points: list[tuple[tuple[float, ...], float]], names: str
) -> tuple[str, ...]:
    """The coordinates of `shape` outside the measured points' range, each as e.g.
    "m 8192 > 2048" (`names`: one letter or word per coordinate, space-separated); empty when
    `shape` lies within every range (interpolated, or measured)."""
    lows, highs = _ranges(shape, points)
    out = []
    for name, x, lo, hi in zip(names.split(), shape, lows, highs, strict=True):
        if x > hi * (1 + 1e-9):
            out.append(f"{name} {x:g} > {hi:g}")
        elif x < lo * (1 - 1e-9):
            out.append(f"{name} {x:g} < {lo:g}")
    return tuple(out)


def _ranges(
    shape: tuple[float, ...], points: list[tuple[tuple[float, ...], float]]
) -> tuple[list[float], list[float]]:
    lows = [min(p[0][i] for p in points) for i in range(len(shape))]
    highs = [max(p[0][i] for p in points) for i in range(len(shape))]
    return lows, highs
