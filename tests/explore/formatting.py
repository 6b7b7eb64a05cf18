"""The page's number formats (format.js `fmt`), written again in Python for the browser tests."""

from __future__ import annotations


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s == 0:
        return "0"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.1f} %"


def fmt_gib(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} GiB"


def fmt_int(x: float | None) -> str:
    return "—" if x is None else f"{round(x):,}"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{round(b)} B"
