"""`WaitClock`: a wait inside another timed one counts once; `watch` routes DTensor's waits."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from fivefold.parallel.wait_clock import WaitClock


def test_a_nested_wait_counts_once_and_take_resets():
    clock = WaitClock(torch.device("cpu"))
    with clock.waiting(), clock.waiting():  # e.g. a DTensor wait in the gradient-norm one
        pass
    with clock.waiting():
        pass
    assert clock.waits == 2
    assert clock.take() >= 0.0
    assert clock.waits == 0 and clock.seconds == 0.0
    try:
        with clock.waiting():
            raise KeyError("inside")
    except KeyError:
        pass
    with clock.waiting():  # an exception left the clock outside any wait
        pass
    assert clock.waits == 2


def test_watch_routes_functional_waits_through_the_newest_clock():
    first, second = WaitClock(torch.device("cpu")), WaitClock(torch.device("cpu"))
    first.watch([])
    second.watch([])
    assert getattr(funcol.wait_tensor, "_fivefold_timed", False)
    assert funcol.AsyncCollectiveTensor.trigger_wait.__globals__["wait_tensor"] is (
        funcol.wait_tensor
    )  # where AsyncCollectiveTensor looks it up, at call time
    assert funcol.wait_tensor(torch.ones(2)).tolist() == [1.0, 1.0]  # nothing in flight
    assert (first.waits, second.waits) == (0, 1)
    with second.waiting():  # inside the runtime's own timed collective: counted there
        funcol.wait_tensor(torch.ones(2))
    assert second.waits == 2
