"""The vocab-parallel embedding under TP (`tensor_parallel.VocabParallelEmbedding`)
makes its weight gradient on the local rows: a Shard(0) [V/tp, D], not the Partial() [V, D] of
DTensor's rule for `RowwiseParallel`, which stays that size while gradients accumulate across
micro-batches. Checked on a fake world of 2 ranks (shapes and bytes; the values are the TP
parity cases' in tests/parallel), and through the runtime on a pipelined ZeRO-1 layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import fivefold.parallel.tensor_parallel as tensor_parallel
from fivefold.parallel.tensor_parallel import VocabParallelEmbedding
from fivefold.specs.recipe import load_recipe
from fivefold.train.plan_check import _measure

VOCAB, HIDDEN, TOKENS = 4096, 64, 128


@pytest.fixture
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _accumulated_grad(style, mesh) -> torch.Tensor:
    torch.manual_seed(0)
    embedding = parallelize_module(nn.Embedding(VOCAB, HIDDEN), mesh, style)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    for _ in range(2):  # two micro-batches accumulate
        embedding(ids).sum().backward()
    return embedding.weight.grad


def test_the_weight_gradient_is_the_local_rows(tp_mesh):
    grad = _accumulated_grad(VocabParallelEmbedding(Shard(1)), tp_mesh)
    assert grad.placements == (Shard(0),)
    local = grad.to_local()
    assert local.shape == (VOCAB // 2, HIDDEN)  # rank 1: rows 2048..4095
    assert local.untyped_storage().nbytes() == VOCAB // 2 * HIDDEN * 4
    # torch's style: a Partial() gradient over the whole vocabulary on every rank
    old = _accumulated_grad(
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), tp_mesh
    )
    assert old.to_local().untyped_storage().nbytes() == VOCAB * HIDDEN * 4


def test_the_output_is_this_ranks_rows(tp_mesh):
    """Rank 1 looks up the ids it holds and gives zeros for the others: its share of the sum
    over TP (which a fake group leaves as it is; no SP, a Replicate() output)."""
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, HIDDEN)
    weight = full.weight.detach().clone()
    embedding = parallelize_module(full, tp_mesh, VocabParallelEmbedding(Replicate()))
    out = embedding(torch.tensor([[0, 2047, 2048, 4095]]))
    assert out.shape == (1, 4, HIDDEN)
    assert not out[0, :2].any()
    assert torch.equal(out[0, 2:], weight[[2048, 4095]])
    assert torch.equal(embedding.weight.to_local(), weight[2048:])


CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"


@pytest.mark.slow
def test_pipelined_zero1_holds_the_embedding_gradient_once(monkeypatch):
    """TP2 x PP2 x ZeRO-1 over 2, 4 micro-batches (gradients accumulate unsharded, fp32) on the
    first stage of a fake world of 8: the runtime's peak falls by at least the half of the
    embedding gradient [4096, 64] x 4 B that belong to the other TP rank."""
    overrides = ["cluster.gpus=8", "plan.tp=2", "plan.pp=2", "plan.dp_shard=2", "plan.zero=1"]
    recipe = load_recipe(str(CONFIG), [*overrides, "plan.micro_batch=1", "plan.grad_accum=4"])
    lean = _measure(recipe, 0, 8)["counted_bytes"]
    monkeypatch.setattr(
        tensor_parallel,
        "VocabParallelEmbedding",
        lambda seq: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    )
    full = _measure(recipe, 0, 8)["counted_bytes"]
    # at most both the accumulated and the new [V, D] gradient during the embedding's backward
    assert VOCAB * HIDDEN * 4 // 2 <= full - lean <= VOCAB * HIDDEN * 4
