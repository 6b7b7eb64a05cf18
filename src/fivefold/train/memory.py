"""Peak memory of a training step.

On CUDA, `torch.cuda.max_memory_allocated` is exact and free. On CPU neither it nor tracemalloc
sees torch's allocations and RSS undercounts, so we count tensor storages with PyTorch's
`MemTracker` (a dispatch-mode tracker in `torch.distributed._tools`): parameters, gradients and
optimizer state registered up front, plus every tensor allocated while the step runs. It slows
the step it watches, so the loop measures one chosen step and leaves it out of throughput.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PeakReading:
    """Filled in when the tracked block exits: peak bytes on the device (0 if not measured)."""

    peak_bytes: int = 0
    by_kind: dict[str, int] | None = None  # Parameter / Gradient / Optstate / Activation / ...
    method: str = ""


@contextmanager
def track_cpu_peak(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None
) -> Iterator[PeakReading]:
    """Measure the CPU peak of the enclosed block, counting the modules' and optimizer's tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker

    reading = PeakReading(method="MemTracker (tensor storages, one step)")
    tracker = MemTracker()
    externals: list = list(modules)
    if optimizer is not None:
        externals.append(optimizer)
    tracker.track_external(*externals)
    with tracker:
        yield reading
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = snapshot.get(torch.device("cpu"), {})
    reading.peak_bytes = int(per_device.get("Total", 0))
    reading.by_kind = {getattr(k, "value", str(k)): int(v) for k, v in per_device.items()}


def cuda_peak_bytes(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device))
