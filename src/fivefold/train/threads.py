"""CPU threads: how many, and how they wait.

Two settings decide whether one process keeps up with two on the same cores:

- the number of intra-op threads: the cores this process may actually use (its CPU affinity,
  capped by a cgroup CPU quota), not the machine's count, unless `OMP_NUM_THREADS` says;
- how OpenMP threads wait between parallel regions. By default they spin; when anything else
  shares the cores they spin against it and a step can take 5x longer (measured here: 110 vs
  684 tokens/s for the small preset on 2 threads with other work on the machine).
  `OMP_WAIT_POLICY=PASSIVE` makes them sleep. It is read when OpenMP loads (at `import torch`),
  so `passive_wait` must run before that: the CLI and the launcher call it.

Importing this module does not import torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
THREADS_ENV = "OMP_NUM_THREADS"


def passive_wait(env: MutableMapping[str, str] = os.environ) -> None:
    """Default OpenMP threads to sleeping, not spinning, while waiting (unless set)."""
    env.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by a cgroup v2 quota (`cpu.max` = "quota period"), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def available_cores() -> int:
    """Cores this process can run on: its affinity mask, capped by the cgroup quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def configure_threads() -> int:
    """Use `available_cores()` intra-op threads unless OMP_NUM_THREADS is set; returns the
    number torch now uses."""
    import torch

    if THREADS_ENV not in os.environ:
        torch.set_num_threads(available_cores())
    return torch.get_num_threads()
