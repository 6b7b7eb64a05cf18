"""The time a rank spends waiting for the others in collectives.

`WaitClock.waiting()` wraps each collective the distributed runtime issues itself: the step's
token count (its first collective), the loss all-reduce, the gradient-norm all-reduce and the
stop agreement. `WaitClock.watch` extends it to the collectives inside the libraries the
runtime builds on: FSDP2's all-gathers and reduce-scatters (every ZeRO stage; through
`FSDPModule.set_custom_all_gather/_reduce_scatter`, the default collectives timed) and the waits
of DTensor's functional collectives (tensor and sequence parallelism, DTensor gradient norms;
the function `AsyncCollectiveTensor` waits in). A wait inside another timed one is counted once.

On CPU (gloo) each blocks the host, so the time inside is the wait for the last rank to arrive
plus a small transfer; on CUDA the host does not block, so two timing events on the current
stream bracket it and are read after the loop's next read-back (a host sync), with no sync of
their own (unmeasured here: no GPU). There, a DTensor wait is a stall of the compute stream,
but FSDP's collectives run on their own streams, overlapping compute: their time counts the
wait for the last rank but may also hide behind compute, so compute = wall - wait is a lower
bound on every rank (the slow rank, whose collectives wait least, still stands out).

Not seen: the all-reduce of `replicate` (plan.zero = 0) and of HSDP's replica groups (issued
by FSDP directly), pipeline sends and receives, ring-attention and expert all-to-all exchanges,
and collectives inside compiled graphs. Details: docs/long-runs.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fivefold.model.torch_features import has

_CURRENT: list[WaitClock] = []  # the clock DTensor's waits count on (the newest runtime's)


class WaitClock:
    """Seconds waited in the wrapped collectives since the last `take`; `waits`: how many."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.waits = 0
        self._depth = 0  # > 0 inside a timed collective
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def waiting(self) -> Iterator[None]:
        if self._depth:  # inside a timed collective: counted there
            yield
            return
        self._depth, self.waits = 1, self.waits + 1
        try:
            if not self.cuda:
                start = time.perf_counter()
                yield
                self.seconds += time.perf_counter() - start
                return
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((begin, end))
        finally:
            self._depth = 0

    def take(self) -> float:
        """The seconds waited since the last call (CUDA: call after a host sync, so the events
        have passed; `elapsed_time` is in ms)."""
        total = self.seconds + sum(b.elapsed_time(e) for b, e in self._events) / 1e3
        self.seconds, self.waits, self._events = 0.0, 0, []
        return total

    def watch(self, dp_modules: list[Any]) -> None:
        """Time the waits inside the FSDP2 collectives of `dp_modules` (`fully_shard`ed) and,
        from now on in this process, inside DTensor's functional collectives."""
        if has("fsdp_custom_comms"):
            gather, scatter = _timed_fsdp_comms(self)
            for module in dp_modules:
                try:
                    module.set_custom_all_gather(gather)
                    module.set_custom_reduce_scatter(scatter)
                except (AttributeError, ValueError):  # replicate, or per-parameter meshes
                    continue
        if has("funcol_wait_tensor"):
            _time_functional_waits()
            _CURRENT[:] = [self]


def _timed_fsdp_comms(clock: WaitClock) -> tuple[Any, Any]:
    """FSDP2's default all-gather and reduce-scatter, each call timed on `clock`."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class TimedAllGather(DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with clock.waiting():
                return super().__call__(*args, **kwargs)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with clock.waiting():
                return super().__call__(*args, **kwargs)

    return TimedAllGather(), TimedReduceScatter()


def _time_functional_waits() -> None:
    """Route `torch.distributed._functional_collectives.wait_tensor` (where every eager
    functional collective is waited for) through the current clock; once per process."""
    import torch.distributed._functional_collectives as funcol

    if getattr(funcol.wait_tensor, "_fivefold_timed", False):
        return
    untimed: Callable[[torch.Tensor], torch.Tensor] = funcol.wait_tensor

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if not _CURRENT or torch.compiler.is_compiling():  # traced: not timed
            return untimed(tensor)
        with _CURRENT[0].waiting():
            return untimed(tensor)

    wait_tensor._fivefold_timed = True  # type: ignore[attr-defined]
    funcol.wait_tensor = wait_tensor
