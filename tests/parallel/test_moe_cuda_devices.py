"""The MoE load-balancing loss across ranks on CUDA, without a GPU: every tensor it builds is
on the router's device (a float64 CPU tensor once met CUDA ones in `torch.cat`, which breaks any
MoE with DP/CP/EP on GPUs), checked on fake `cuda` tensors; its value on one rank is the
single-process loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fivefold.model.moe import load_balancing_loss, route
from fivefold.parallel.expert_parallel import global_load_balancing_loss

E, K, N = 8, 2, 12


@pytest.fixture
def reduced(monkeypatch):
    """dist.all_reduce on one rank: the tensor as it is; records what was reduced."""
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: seen.append(tensor))
    return seen


def test_every_piece_is_on_the_routers_cuda_device(reduced):
    with FakeTensorMode():
        logits = torch.randn(N, E, device="cuda")
        loss = global_load_balancing_loss(route(logits, K), group=None)
    (stats,) = reduced
    assert stats.device.type == "cuda" and stats.dtype == torch.float64
    assert stats.shape == (2 * E + 2,)
    assert loss.device.type == "cuda" and loss.shape == ()
    # (no autograd here: a CPU-only torch aborts on fake CUDA tensors that require grad; the
    # gradient is checked on CPU below)


def test_one_rank_gives_the_single_process_loss_and_gradient(reduced):
    torch.manual_seed(0)
    logits = torch.randn(N, E, requires_grad=True)
    mine = global_load_balancing_loss(route(logits, K), group=None)
    (grad_mine,) = torch.autograd.grad(mine, logits)
    reference = load_balancing_loss(route(logits, K))
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_mine, grad_ref, rtol=1e-6, atol=1e-7)
    counts = reduced[0][:E]
    assert counts.sum().item() == N * K  # every token's K choices counted once
