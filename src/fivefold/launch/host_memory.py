"""Host memory: keep what a CPU step frees inside the process, so the next step reuses it.

glibc hands freed blocks above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
and the free top of its heap back to the kernel. A training step frees its activations and
allocates them again the next step, so on a CPU every step can page-fault them in afresh.
`benchmarks/host_memory.py` (idle 2-core machine, whole steps of the small preset, medians of
three alternating trials) measures kept / default: 0.978 on one rank, 0.920 on two ranks with
ZeRO-1. PyTorch's CPU performance guide advises preloading jemalloc or tcmalloc for this;
glibc's own `mallopt` does it in-process, with no preload: the mmap, trim and top-pad
thresholds at 1 GiB, so blocks up to 1 GiB come from the heap and freed memory stays in it.
The peak is unchanged: a step reaches it again anyway. Nothing happens on a C library without
`mallopt` (musl, macOS).

Measured only on whole steps (the figures above): a micro-benchmark of freeing one block and
allocating it again depends on the heap's layout and glibc's dynamic threshold either way.

Written by hand: torch exposes no allocator setting for the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**30


def keep_freed_memory() -> None:
    """Set glibc's thresholds so freed memory stays in the process (glibc's `mallopt` accepts
    any value and reports nothing useful; elsewhere there is no `mallopt` and nothing
    happens)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD):
        mallopt(option, KEEP_BYTES)
