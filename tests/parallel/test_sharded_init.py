"""Sharded initialisation: any shard, computed alone, equals the same slice of the full tensor.

Single-process: `fill_normal_shard` on index subsets (blocks, strided rows, column subsets) of a
parameter against the full tensor drawn the same way. Four gloo ranks: FSDP2 x TP, EP x FSDP2,
each rank initialising only its shards (with blocks of a few rows, so shards cross block
boundaries) must reproduce the single-process weights bitwise, without any full-size tensor
appearing on a rank (live tensor storage counted during materialisation and initialisation).
"""

from __future__ import annotations

import pytest
import torch
from harness import spawn_ranks

import fivefold.model.init as init_mod
from fivefold.model import build_model
from fivefold.specs.model import ModelSpec

TINY = ModelSpec(
    "t", layers=2, hidden=32, heads=4, kv_heads=2, ffn=72, vocab=2050, seq_len=32,
    rope_theta=10_000.0,
)  # fmt: skip
TINY_MOE = TINY.with_(name="tm", experts=4, top_k=2, expert_ffn=24, shared_experts=1)


def _full(shape, seed=7, fqn="layers.0.feed_forward.w1.weight"):
    out = torch.empty(shape)
    init_mod.fill_normal_shard(out, fqn, shape, [torch.arange(s) for s in shape], seed, 0.02)
    return out


@pytest.mark.parametrize("shape", [(37, 19), (3, 10, 7), (5,)])
def test_any_index_subset_equals_the_full_slice(monkeypatch, shape):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 40)  # several blocks per tensor
    full = _full(shape)
    assert full.std().item() == pytest.approx(0.02, rel=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        indices = [torch.randperm(s, generator=g)[: max(1, s // 2)].sort().values for s in shape]
        indices[0] = indices[0].flip(0)  # any local order, not only ascending
        part = torch.empty([len(i) for i in indices])
        init_mod.fill_normal_shard(part, "layers.0.feed_forward.w1.weight", shape, indices, 7, 0.02)
        assert torch.equal(part, full[torch.meshgrid(*indices, indexing="ij")])
    bf16 = torch.empty(shape, dtype=torch.bfloat16)
    init_mod.fill_normal_shard(
        bf16, "layers.0.feed_forward.w1.weight", shape, [torch.arange(s) for s in shape], 7, 0.02
    )
    assert torch.equal(bf16, full.to(torch.bfloat16))


def test_blocks_and_names_draw_distinct_values(monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 19 * 4)
    full = _full((37, 19))
    assert not torch.equal(full[:4], full[4:8])  # consecutive blocks are not one stream reused
    assert not torch.equal(full, _full((37, 19), fqn="layers.0.feed_forward.w3.weight"))
    assert not torch.equal(full, _full((37, 19), seed=8))


def _sharded_init(rank: int, world: int, layout: str, block_elements: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fivefold.parallel.expert_parallel import apply_expert_parallel
    from fivefold.parallel.tensor_parallel import apply_tensor_parallel
    from fivefold.train.memory_counter import StorageCounter

    init_mod.BLOCK_ELEMENTS = block_elements
    spec = TINY_MOE if layout == "ep" else TINY
    reference = build_model(spec)
    reference.to_empty(device="cpu")
    reference.init_weights(3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "inner"))
    model = build_model(spec)
    if layout == "tp":
        apply_tensor_parallel(model, mesh["inner"], spec, sequence_parallel=True)
    else:
        apply_expert_parallel(model, mesh["inner"])
    for block in model.layers.values():
        if layout == "ep":
            fully_shard(block.moe.experts, mesh=mesh["dp"])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    counter = StorageCounter()
    with counter:
        model.to_empty(device="cpu")
        model.init_weights(3)
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    largest_local = max(p.to_local().numel() * 4 for p in model.parameters())
    deviations = {}
    for (name, param), expected in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert isinstance(param, DTensor), name
        deviations[name] = (param.full_tensor() - expected).abs().max().item()
    return {
        "dev": deviations,
        "peak": counter.peak_bytes,
        "local": local,
        "largest_local": largest_local,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_each_rank_initialises_its_shards_as_the_single_process_run(layout):
    block = 2 * 32  # two rows of a [., 32] weight: shards cross block boundaries
    ranks = spawn_ranks(4, _sharded_init, (layout, block), pass_rank=True)
    for out in ranks:
        assert all(dev == 0.0 for dev in out["dev"].values()), out["dev"]
        # the shards, FSDP2's padded copy of one shard in `to_empty`, one block and the index
        # proxies (32 KiB); the old way (a full 2050 x 32 fp32 embedding drawn) is 256 KiB more
        assert out["peak"] <= out["local"] + out["largest_local"] + 32 * 1024, out
