"""CUDA peak memory compared like with like, checked without a GPU (`torch.cuda` monkeypatched).

The loop resets the allocator's peak statistics right before the measured step, so start-up,
checkpoint loading, compilation and evaluation are not in its peak; the allocated peak is
compared with the prediction less the CUDA context and fragmentation, the reserved peak plus
the context (the device's used memory outside the allocator) with the whole prediction. The
loop's own measured step is run too (on a stand-in runtime), not only the tracker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fivefold.parallel.report import format_rows, memory_only_prediction, record
from fivefold.planner.memory.options import MemoryOptions
from fivefold.planner.memory.stage import all_stage_memory
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import MODEL_PRESETS
from fivefold.train.loop import Trainer
from fivefold.train.memory_counter import track_cuda_peak

GIB = 2**30


def test_the_peak_is_read_from_statistics_reset_before_the_step(monkeypatch) -> None:
    events = []
    stats = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: stats["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9 * GIB)
    # 80 GiB device, 69 GiB free: 11 GiB used, 9 of them reserved by the allocator.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (69 * GIB, 80 * GIB))
    with track_cuda_peak(torch.device("cuda", 0)) as reading:
        assert events == ["reset"]  # before the step's first allocation
        stats.update(allocated=7 * GIB, reserved=10 * GIB)  # what the step reached
    assert reading.peak_bytes == 7 * GIB
    assert reading.reserved_bytes == 10 * GIB + 2 * GIB  # + context: 11 used - 9 reserved


def test_allocated_is_compared_without_context_and_fragmentation() -> None:
    spec, plan = MODEL_PRESETS["small"], ParallelPlan(precision="bf16-mixed", micro_batch=2)
    cuda = memory_only_prediction(spec, plan, fsdp_wrapped=True, cuda=True)[0]
    # The planner's CUDA context (0.75 GiB) and fragmentation (5 % of the tensors it sees).
    stage = all_stage_memory(spec, plan, [1], MemoryOptions(runtime="fivefold-eager"))[0]
    fragmentation = stage.other_terms["fragmentation"]
    assert 0 < fragmentation < 0.05 * stage.total
    outside = 0.75 * GIB + fragmentation
    assert (cuda["total"] - cuda["allocated"]) * GIB == pytest.approx(outside, rel=1e-12)
    cpu = memory_only_prediction(spec, plan, fsdp_wrapped=False, cuda=False)[0]
    assert cpu["allocated"] == cpu["total"]  # CPU figures unchanged
    row = {
        "stage": 0,
        "ranks": [0],
        "predicted_peak_bytes": 1.0 * GIB,
        "measured_peak_bytes": 1.25 * GIB,
        "predicted_reserved_bytes": 2.0 * GIB,
        "measured_reserved_bytes": 2.5 * GIB,
        "predicted_tenants": {},
        "measured_tenants": {},
        "predicted_step_s": None,
        "measured_step_s": None,
    }
    entry = record([row], "note")["stages"][0]
    assert entry["memory_error"] == pytest.approx(-0.2)
    assert entry["reserved_error"] == pytest.approx(-0.2)
    text = format_rows("single", [row], "note")
    assert "reserved + context: predicted 2.000 GiB, measured 2.500 GiB, -20.0%" in text


def test_the_loop_measures_its_cuda_step_with_the_allocator(monkeypatch) -> None:
    """The loop's measured step on a (fake) CUDA runtime: statistics reset right before the
    step, the step's allocator peak read after it and handed to the runtime's report."""
    events, stats, recorded = [], {"allocated": 0, "reserved": 0}, []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: stats["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 9 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (69 * GIB, 80 * GIB))

    def device_step(micro_batches, pending, samples):
        events.append("step")
        stats.update(allocated=7 * GIB, reserved=10 * GIB)
        return "done"

    runtime = SimpleNamespace(
        device=torch.device("cuda", 0),
        model_parts=[],
        record_peak_memory=lambda *reading: recorded.append(reading),
    )
    loop = SimpleNamespace(runtime=runtime, optimizer=None, _device_step=device_step)
    assert Trainer._measured_step(loop, [], [], (0, 0)) == "done"
    assert events == ["reset", "step"]
    assert loop.cpu_peak.peak_bytes == 7 * GIB
    ((peak, _tenants, reserved),) = recorded
    assert (peak, reserved) == (7 * GIB, 12 * GIB)
