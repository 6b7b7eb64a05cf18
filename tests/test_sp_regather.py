"""Sequence parallelism keeps each block's gathered inputs as their sequence shard
(`fivefold.parallel.sp_regather`): fivefold's runtime under TP2+SP on a fake world of 2 ranks
(the route `plan check` counts), one step, its counted peak with and without the re-gather; the
planner's eager activations follow by the same bytes. Values are unchanged: the TP+SP parity
cases (tests/parallel) compare the runs with one process."""

from __future__ import annotations

from pathlib import Path

import pytest

import fivefold.parallel.runtime_core as runtime_core
from fivefold.planner.memory.activations import layer_activation_bytes
from fivefold.planner.memory.options import MemoryOptions
from fivefold.specs.recipe import load_recipe
from fivefold.train.plan_check import _measure

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
# Activations dominate: 2 layers of width 64 over 1024 tokens, fp32.
OVERRIDES = [
    "cluster.gpus=2",
    "plan.tp=2",
    "plan.sp=true",
    "plan.micro_batch=1",
    "plan.grad_accum=1",
    "model.seq_len=1024",
]


def _counted(recipe) -> int:
    return _measure(recipe, 0, 2)["counted_bytes"]


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_gathered_inputs_are_kept_as_their_shard(monkeypatch, recompute):
    recipe = load_recipe(str(CONFIG), [*OVERRIDES, f"plan.recompute={recompute}"])
    model, plan = recipe.model, recipe.plan
    lean = _counted(recipe)
    monkeypatch.setattr(runtime_core, "apply_sp_regather", lambda block: 0)
    gathered = _counted(recipe)
    # Per layer, the attention's and the MLP's gathered inputs [1, 1024, 64] in fp32 (4 B) are
    # freed after the forward; their shards [1, 512, 64] stay: 2 x 4 x 1024 x 64 / 2 B.
    saved = model.layers * 2 * 4 * 1024 * 64 // 2
    assert gathered - lean == saved == 524_288
    # The planner's eager layer: the same bytes fewer than without sequence parallelism's
    # shard kept (the layer's terms at sp with and without the re-gather: full recompute keeps
    # only the block input and does not re-gather).
    eager = MemoryOptions(runtime="fivefold-eager", fsdp_wrapped=True)
    per_layer = layer_activation_bytes(model, plan, False, eager)
    monkeypatch.setattr("fivefold.planner.memory.activations.sp_regathered_inputs", lambda *args: 0)
    assert layer_activation_bytes(model, plan, False, eager) - per_layer == saved / model.layers


def test_full_recompute_is_unchanged(monkeypatch):
    recipe = load_recipe(str(CONFIG), [*OVERRIDES, "plan.recompute=full"])
    with_regather = _counted(recipe)
    monkeypatch.setattr(runtime_core, "apply_sp_regather", lambda block: 0)
    assert _counted(recipe) == with_regather
