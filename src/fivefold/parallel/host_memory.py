"""Host memory: keep what a CPU step frees inside the process, so the next step reuses it.

glibc hands freed blocks above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
and the free top of its heap back to the kernel. A training step frees its activations and
allocates them again the next step, so on a CPU every step page-faults them in afresh: on the
small preset (fp32, micro-batch 2, one rank, 2 cores) 267 ms a step against 236 ms with the
memory kept (measured here). PyTorch's CPU performance guide advises preloading jemalloc or
tcmalloc for this; glibc's own `mallopt` does it in-process, with no preload: the mmap
threshold at its maximum (32 MiB; larger blocks are still mapped and unmapped) and the trim
threshold and top pad at 1 GiB (freed memory stays in the heap). The peak is unchanged: a step
reaches it again anyway. Nothing happens on a C library without `mallopt` (musl, macOS).

Written by hand: torch exposes no allocator setting for the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's limit on 64-bit (4 MiB x sizeof(long))
KEEP_BYTES = 2**30


def keep_freed_memory() -> bool:
    """Set glibc's thresholds so freed memory stays in the process; True when glibc took them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
        (M_TRIM_THRESHOLD, KEEP_BYTES),
        (M_TOP_PAD, KEEP_BYTES),
    )
    return all(mallopt(option, value) == 1 for option, value in settings)
