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

import os
from collections.abc import MutableMapping

from fivefold.specs.profile import available_cores

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
THREADS_ENV = "OMP_NUM_THREADS"


def passive_wait(env: MutableMapping[str, str] = os.environ) -> None:
    """Default OpenMP threads to sleeping, not spinning, while waiting (unless set)."""
    env.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def configure_threads() -> int:
    """Use `available_cores()` intra-op threads unless OMP_NUM_THREADS is set; returns the
    number torch now uses."""
    import torch  # lazily: the CLI imports this module before torch (see passive_wait)

    if THREADS_ENV not in os.environ:
        torch.set_num_threads(available_cores())
    return torch.get_num_threads()
