"""torch's pipeline stages make one output-gradient receive buffer per micro-batch and keep
them through the step; fivefold's (`fivefold.parallel.pipeline._grad_buffers`) hold memory
only from the receive to the end of that micro-batch's backward, except in the V-shaped
schedules. The first stage of TP2 x PP2 x ZeRO-1 over 2 (tiny model, fp32, 4 micro-batches)
on a fake world of 8 ranks, the route `plan check` counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import fivefold.parallel.pipeline as pipeline
from fivefold.planner.memory.buffers import other_terms
from fivefold.planner.memory.options import MemoryOptions
from fivefold.specs.partition import stage_layer_counts
from fivefold.specs.recipe import load_recipe
from fivefold.train.plan_check import _CheckedRuntime, _measure, _micro_batches, fake_world

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
LAYOUT = ["cluster.gpus=8", "plan.tp=2", "plan.pp=2", "plan.dp_shard=2", "plan.zero=1"]
MICRO = ["plan.micro_batch=1", "plan.grad_accum=4"]
# a boundary tensor: [1 sequence, 128 tokens / 2 (SP), 64] in fp32
BOUNDARY = 128 // 2 * 64 * 4


def _grad_buffer_bytes(schedule: str) -> list[int]:
    """Bytes each output-gradient receive buffer of rank 0 holds after one step."""
    recipe = load_recipe(str(CONFIG), [*LAYOUT, *MICRO, f"plan.schedule={schedule}"])
    with fake_world(recipe, 0, 8), FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        runtime = _CheckedRuntime(recipe)
        runtime.train_step(_micro_batches(recipe))
        stage = runtime.pipeline.stages[0]
        return [
            info.buffer.untyped_storage().nbytes()
            for infos in stage.grad_recv_info.values()
            for info in infos
            if isinstance(info.buffer, torch.Tensor)
        ]


def test_gradient_receive_buffers_are_free_after_the_step():
    assert _grad_buffer_bytes("1f1b") == [0, 0, 0, 0]


@pytest.mark.slow
def test_the_peak_holds_fewer_gradient_buffers(monkeypatch):
    """The first stage's counted peak with torch's buffers kept, less with them released: by
    two of the four buffers at this peak; the planner prices one slot per chunk instead of
    one per micro-batch."""
    recipe = load_recipe(str(CONFIG), [*LAYOUT, *MICRO])
    released = _measure(recipe, 0, 8)["counted_bytes"]
    monkeypatch.setattr(pipeline, "_grad_buffers", lambda infos, held: None)
    kept = _measure(recipe, 0, 8)["counted_bytes"]
    assert kept - released == 2 * BOUNDARY
    model, plan = recipe.model, recipe.plan
    counts = stage_layer_counts(model, 2)
    eager = MemoryOptions(runtime="fivefold-eager", fsdp_wrapped=True)
    assert other_terms(model, plan, counts, [0], eager)["pipeline_slots"] == BOUNDARY
