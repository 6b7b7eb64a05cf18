"""The CPU memory counter (`fivefold.train.memory_counter`): resize-aware, split into tenants, and
byte for byte what PyTorch's `MemTracker` reports on real layouts (1 rank, DP2 ZeRO-3 whose
FSDP2 frees gathered parameters with `storage.resize_(0)`, DP2 ZeRO-0)."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from fivefold.train.memory_counter import StorageCounter, track_cpu_peak


def test_resize_is_counted_at_the_storage_size() -> None:
    counter = StorageCounter()
    with counter:
        a = torch.empty(1000)  # 4,000 B
        a.untyped_storage().resize_(0)  # freed in place: 0 live
        b = torch.empty(500)  # 2,000 B
        a.untyped_storage().resize_(3000)  # re-allocated: 2,000 + 3,000
        a.untyped_storage().resize_(0)
    assert counter.peak_bytes == 5_000
    assert counter.current_bytes == 2_000
    assert b.numel() == 500
    assert torch.UntypedStorage.resize_ is not None and counter._original_resize is not None


def test_held_tensors_count_from_the_start_until_replaced() -> None:
    # A pipeline's receive buffer exists before the step (4,000 B) and is replaced mid-step by a
    # tensor of 2,000 B: counted from the start, freed when replaced, never counted twice.
    model = torch.nn.Linear(10, 10, bias=False)  # 400 B
    held = {"buffer": torch.empty(1000)}
    model.held_tensors = lambda: [held["buffer"], held["buffer"]]
    with track_cpu_peak([model]) as reading:
        new = torch.empty(500)
        held["buffer"] = new
        after = torch.empty(250)
    assert reading.start_bytes == 400 + 4_000
    assert reading.peak_bytes == 400 + 4_000 + 2_000
    assert after.numel() == 250


def test_peak_is_split_into_tenants() -> None:
    model = torch.nn.Linear(256, 256, bias=False)  # 65,536 params = 262,144 B
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 256)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track_cpu_peak([model], opt) as reading:
        model(x).sum().backward()
        opt.step()
    # At the peak: the weight, m and v (+ a 4-byte step count), the gradient, and AdamW's
    # temporaries of one parameter-sized tensor or two (the rest).
    t = reading.tenants
    assert t["params"] == 262_144
    assert t["optimizer"] == 2 * 262_144 + 4
    assert t["grads"] == 262_144
    assert sum(t.values()) == reading.peak_bytes
    assert 262_144 <= t["activations"] <= 2 * 262_144 + 4 * 8 * 256


def _both(plan_extra: dict) -> tuple[int, int, dict]:
    """One training step of the small preset measured by our counter, the next by MemTracker."""
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from fivefold.parallel.distributed_runtime import DistributedRuntime
    from fivefold.specs.recipe import recipe_from_dict
    from fivefold.train.config import parse_train_config
    from fivefold.train.data import Batch
    from fivefold.train.optim import build_optimizer

    plan = {"precision": "fp32", "micro_batch": 1, **plan_extra}
    recipe = recipe_from_dict(
        {"model": {"preset": "small"}, "plan": plan, "train": {"device": "cpu", "steps": 10}},
        default_world=dist.get_world_size(),
    )
    train = parse_train_config(recipe).train
    runtime = DistributedRuntime(recipe, train)
    optimizer = build_optimizer(runtime.model_parts, train)
    seq = recipe.model.seq_len
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step() -> None:
        tokens = torch.randint(0, recipe.model.vocab, (1, seq), generator=gen)
        batch = Batch(tokens, tokens.clone(), torch.arange(seq)[None], torch.zeros_like(tokens))
        runtime.train_step([batch])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with track_cpu_peak(runtime.model_parts, optimizer) as reading:
        step()
    tracker = MemTracker()
    tracker.track_external(*runtime.model_parts, optimizer)
    with tracker:
        step()
    peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    return reading.peak_bytes, peak, reading.tenants


@pytest.mark.parametrize(
    ("world", "plan"),
    [(1, {}), (2, {"dp_shard": 2, "zero": 3}), (2, {"dp_replicate": 2})],
    ids=["1-rank", "dp2-zero3", "dp2-zero0"],
)
def test_counter_equals_memtracker(world: int, plan: dict) -> None:
    for ours, theirs, tenants in run_ranks(world, _both, plan, timeout_s=240):
        assert ours == theirs, (ours, theirs)
        assert sum(tenants.values()) == ours
        # 6,450,432 fp32 parameters (the small preset), sharded over the dp_shard ranks.
        assert tenants["params"] == 6_450_432 * 4 // plan.get("dp_shard", 1)
