"""One calibration, in order: which device is measured and by how many ranks, the kernel
measurements then the collectives, their time estimate, and the device profile built from the
rows. The caller (`fivefold calibrate`) prints; callbacks report each measurement as it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fivefold.specs.profile import available_cores

# Seconds per measurement on two idle cores (measured 2026-11-26 on the defaults, 67 s with the
# machine loaded 2x); a collective's row takes longer by ranks / cores when ranks share cores.
KERNEL_S = 0.07
COLLECTIVE_S = 0.12
LOADED = 2.5  # how much longer on a machine as loaded as the one those figures came from


def estimate_s(kernels: int, collectives: int, ranks: int, cores: int) -> float:
    """Seconds a calibration takes on idle cores for this many measurements."""
    shared = max(1.0, ranks / max(cores, 1))
    return kernels * KERNEL_S + collectives * COLLECTIVE_S * shared


def measuring_device(timing) -> bool:
    """Measure the GPU when torch sees one (True), else the CPU: the device resolution every
    run uses (`fivefold.parallel.device.uses_cuda`)."""
    from fivefold.parallel.device import uses_cuda

    if uses_cuda("auto"):
        timing.use_device("cuda")
        return True
    timing.use_device("cpu")
    return False


@dataclass
class Calibration:
    """What one calibration measures: on the GPU (`cuda`) or the CPU (its `bf16` support),
    `kernels` as (label, thunk) steps, then `collectives` rows over `ranks` processes after
    each of `gemms` (a model's MLP GEMM, or none)."""

    model: Any
    plan: Any
    quick: bool
    cuda: bool
    bf16: str
    ranks: int
    kernels: list
    gemms: tuple
    collectives: int

    @property
    def idle_s(self) -> float:
        return estimate_s(len(self.kernels), self.collectives, self.ranks, available_cores())


def plan_calibration(model, plan, ranks: int, quick: bool, also: tuple = ()) -> Calibration:
    """The measurements for `model` (and the `also` models) at `plan`'s micro-batch over up to
    `ranks` processes; on a GPU every local GPU is a rank (NCCL), so one GPU measures no
    collectives."""
    from fivefold.calibration import comm, timing
    from fivefold.calibration.compute import compute_steps
    from fivefold.calibration.machine import bf16_support, cuda_bf16_support

    cuda = measuring_device(timing)
    bf16 = cuda_bf16_support() if cuda else bf16_support()
    if cuda:
        import torch

        ranks = min(ranks, torch.cuda.device_count())
    kernels = compute_steps(model, plan, ranks, quick, bf16, also)
    gemms = tuple(comm.gaps([model, *also], plan.micro_batch))
    collectives = comm.steps_count(ranks, quick, len(gemms), cuda) if ranks >= 2 else 0
    return Calibration(model, plan, quick, cuda, bf16, ranks, kernels, gemms, collectives)


def run_calibration(
    cal: Calibration,
    on_kernel: Callable[[str], None],
    on_kernel_done: Callable[[], None],
    on_collective: Callable[[Any], None],
):
    """Measure `cal`'s kernels, then its collectives, into a device profile; `on_kernel(label)`
    before each kernel step, `on_kernel_done()` after it, `on_collective(sample)` per row."""
    from fivefold.calibration import comm
    from fivefold.calibration.tables import build_profile, sort_rows

    rows: list = []
    for label, thunk in cal.kernels:
        on_kernel(label)
        rows += thunk()
        on_kernel_done()
    backend, samples, shared = comm.measure_collectives(
        cal.ranks, cal.quick, on_collective, (cal.model, cal.plan), cal.gemms
    )
    rows += shared
    fits = comm.fit_collectives(samples)
    return build_profile(cal.model, cal.ranks, cal.bf16, sort_rows(rows), backend, samples, fits)
