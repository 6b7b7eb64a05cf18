"""Seconds and bytes in words, with enough digits for any model size."""

from __future__ import annotations

from fivefold.units import GiB


def seconds(x: float) -> str:
    """'1.23 s', '12.3 ms' or '45 us': enough digits for any model size."""
    if x == 0:
        return "0 s"
    if abs(x) >= 0.1:
        return f"{x:.2f} s"
    if abs(x) >= 1e-4:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def gib(x_bytes: float) -> str:
    """'12.55 GiB' or '3.2 MiB' for small models."""
    if abs(x_bytes) >= 0.01 * GiB or x_bytes == 0:
        return f"{x_bytes / GiB:.2f} GiB"
    return f"{x_bytes / 2**20:.1f} MiB"
