"""How a kernel is timed: the lower quartile of repeats from cold caches, on the device measured.

On a CPU by this thread's CPU time (one thread) or wall time; on a GPU between CUDA events
after an L2 flush. `use_device` picks the device for every measurement after it. A CPU's GEMMs
are timed with warm caches instead (`gemm_caches_cold`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Budget:
    """How long to measure: repeats per kernel and the seconds that may stretch them."""

    min_repeats: int = 3
    max_repeats: int = 15
    seconds: float = 0.15  # per kernel, after the warm-up


QUICK = Budget(2, 4, 0.03)
GRID = Budget(2, 4, 0.02)  # the device grid's points: many, and interpolated between


def lower_quartile(times: list[float]) -> float:
    """The median of the faster half of `times`."""
    ordered = sorted(times)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # more than the last-level cache
_flush_buffer: torch.Tensor | None = None
_device = torch.device("cpu")  # where kernels are measured (`use_device`)


def use_device(device: str | torch.device) -> None:
    """Measure on `device` from now on ("cpu", or "cuda": CUDA events time each kernel)."""
    global _device, _flush_buffer
    _device, _flush_buffer = torch.device(device), None
    if _device.type == "cuda" and _device.index is None:
        _device = torch.device("cuda", torch.cuda.current_device())


def randn_on_device(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal values on the measuring device; a GPU's are drawn there (its operands
    are too large to draw on the host quickly), from torch's global generator."""
    if _device.type == "cpu":
        return torch.randn(*shape, generator=gen)
    return torch.randn(*shape, device=_device)


def flush_caches() -> None:
    """Write a buffer larger than the last-level cache (L2 on a GPU), evicting the operands."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.zeros(FLUSH_BYTES[_device.type] // 4, device=_device)
    _flush_buffer.add_(1.0)


def timed_s(fn: Callable[[], object]) -> float:
    """Seconds of one `fn()`: on a GPU between two CUDA events around its kernels (the host
    only queues them), on a CPU by `clock()`."""
    if _device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    now = clock()
    tick = now()
    fn()
    return now() - tick


def clock() -> Callable[[], float]:
    """The clock kernels are timed with: this thread's CPU time when torch runs one thread (the
    kernel runs on it, and time other processes take from the core is not counted, so a busy
    machine measures what an idle one would), else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def gemm_caches_cold() -> bool:
    """Whether GEMMs are timed from cold caches: on a GPU (its L2 holds little of a step's
    GEMM operands), not on a CPU, where a step's GEMMs find most of their operands in the
    caches (the input just written by the kernel before; a CPU-sized model's weights in the
    last-level cache). Measured 2026-11-28 on the 2-core EPYC (32 MiB L3, one thread, thread
    CPU time, load 10-17): a one-process step's GEMMs of three models calibrate never saw
    (hidden 192-320) took 8 % less than the same GEMMs timed after a 64 MiB flush and 4 %
    more than timed warm; 2048-sided GEMMs, bound by arithmetic, differ by a few per cent."""
    return _device.type != "cpu"


def typical_time_s(fn: Callable[[], object], budget: Budget, cold: bool = True) -> float:
    """Lower-quartile seconds of `fn()` over the budget's repeats, after one warm-up call;
    each repeat after a cache flush when `cold`, else right after the one before."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < budget.min_repeats or (
        len(times) < budget.max_repeats and time.perf_counter() - started < budget.seconds
    ):
        if cold:
            flush_caches()
        times.append(timed_s(fn))
    return lower_quartile(times)


def backward_time_s(forward: Callable[[], torch.Tensor], grad: torch.Tensor, budget: Budget):
    """Lower-quartile seconds of the backward alone of `forward()` (a fresh graph each time)."""
    times = []
    for _ in range(max(budget.min_repeats, 2) + 1):
        out = forward()
        flush_caches()
        times.append(timed_s(lambda out=out: out.backward(grad)))
    return lower_quartile(times[1:])


def measured_device() -> torch.device:
    """The device kernels are measured on (`use_device`)."""
    return _device
