"""The MoE feed-forward: routing, load-balancing loss, dispatcher, equivalences, training."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from fivefold.model import (
    FeedForward,
    LocalDispatcher,
    MoE,
    cross_entropy_loss,
    load_balancing_loss,
    route,
)
from tiny_models import TINY_MOE, make


def random_moe(top_k: int = 2, experts: int = 4, shared: int = 1, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim=8, num_experts=experts, top_k=top_k, expert_hidden=6, shared_experts=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def test_routing_gates_are_renormalised_top_k():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.1, 0.4]])
    routing = route(probs.log(), top_k=2)
    assert routing.expert_indices[0].tolist() == [1, 2]
    torch.testing.assert_close(routing.gates[0], torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    torch.testing.assert_close(routing.gates[1], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(routing.probs, probs)


def test_routing_gates_without_renormalising_are_the_probabilities():
    """Qwen3-MoE's norm_topk_prob = false: the top-k softmax probabilities as they are."""
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    routing = route(probs.log(), top_k=2, norm_topk=False)
    assert routing.expert_indices[0].tolist() == [1, 2]
    torch.testing.assert_close(routing.gates[0], torch.tensor([0.5, 0.3]))
    moe = random_moe(shared=0)
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        renormalised = moe(x)
        moe.norm_topk = False
        kept = moe(x)
    assert float((renormalised - kept).abs().max()) > 1e-3


def test_aux_loss_hand_check():
    # top-1 of 2 experts: tokens pick 0, 0, 0, 1 -> f = [3/4, 1/4]; mean probs P = [0.6, 0.4]
    # loss = E * sum f_e P_e = 2 * (0.75 * 0.6 + 0.25 * 0.4) = 1.1
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.2, 0.8]])
    assert load_balancing_loss(route(probs.log(), top_k=1)).item() == pytest.approx(1.1)

    moe = MoE(dim=2, num_experts=2, top_k=1, expert_hidden=3, aux_loss_coef=0.01)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
        for p in moe.experts.parameters():
            p.normal_()
    moe(probs.log().view(1, 4, 2))  # router logits = log probs
    assert moe.aux_loss.item() == pytest.approx(0.011)


def test_aux_loss_is_one_when_perfectly_balanced():
    # top-2 of 4: each expert gets 2 of the 4 assignments, uniform probabilities
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0]])
    routing = route(logits, top_k=2)
    routing.probs = torch.full((2, 4), 0.25)
    assert load_balancing_loss(routing).item() == pytest.approx(1.0)


def test_single_expert_equals_dense_feed_forward():
    torch.manual_seed(0)
    dense = FeedForward(8, 12)
    moe = MoE(dim=8, num_experts=1, top_k=1, expert_hidden=12)
    with torch.no_grad():
        moe.router.weight.normal_()
        moe.experts.w1[0].copy_(dense.w1.weight)
        moe.experts.w2[0].copy_(dense.w2.weight)
        moe.experts.w3[0].copy_(dense.w3.weight)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(moe(x), dense(x), atol=1e-6, rtol=1e-6)
    assert moe.aux_loss.item() == pytest.approx(0.01)  # one expert: f = P = 1


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token: sum over the chosen experts of gate * SwiGLU_e(x) + shared(x)."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(moe.router(tokens), moe.top_k)
    out = moe.shared_expert(tokens).clone()
    e = moe.experts
    for n in range(tokens.shape[0]):
        for k in range(moe.top_k):
            i = routing.expert_indices[n, k]
            h = torch.nn.functional.silu(e.w1[i] @ tokens[n]) * (e.w3[i] @ tokens[n])
            out[n] += routing.gates[n, k] * (e.w2[i] @ h)
    return out.view_as(x)


def test_moe_matches_token_by_token_reference():
    moe = random_moe()
    x = torch.randn(3, 7, 8)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), atol=1e-5, rtol=1e-5)


def test_local_dispatcher_groups_by_expert_and_round_trips():
    tokens = torch.arange(4.0).view(4, 1).repeat(1, 3)  # token n is the row [n, n, n]
    indices = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    gates = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0], [0.5, 0.5]])
    routing = route(torch.zeros(4, 3), top_k=2)
    routing.expert_indices, routing.gates = indices, gates
    dispatcher = LocalDispatcher()
    grouped, per_expert, handle = dispatcher.dispatch(tokens, routing)
    assert per_expert.tolist() == [3, 2, 3]
    assert grouped[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # expert 0, then 1, then 2
    combined = dispatcher.combine(grouped * 2.0, handle)  # "expert" doubles its input
    torch.testing.assert_close(combined, tokens * 2.0)  # gates sum to 1 per token


class CountingDispatcher(LocalDispatcher):
    def __init__(self) -> None:
        self.calls = 0

    def dispatch(self, tokens, routing):
        self.calls += 1
        return super().dispatch(tokens, routing)


def test_dispatcher_is_swappable():
    moe = random_moe()
    x = torch.randn(2, 4, 8)
    expected = moe(x)
    moe.dispatcher = CountingDispatcher()
    assert torch.equal(moe(x), expected)
    assert moe.dispatcher.calls == 1


def test_gradients_reach_router_and_every_expert():
    moe = random_moe(top_k=2, experts=4)
    x = torch.randn(4, 8, 8)
    (moe(x).square().mean() + moe.aux_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    per_expert = moe.experts.w1.grad.abs().sum(dim=(1, 2))
    assert (per_expert > 0).all()  # 32 tokens x top-2: every expert is used


def test_model_layout_dense_layers_and_aux_sum():
    model = make(TINY_MOE.with_(layers=3, dense_layers=1))
    assert model.layers["0"].moe is None and model.layers["0"].feed_forward is not None
    assert model.layers["1"].feed_forward is None and model.layers["2"].moe is not None
    assert model.layers["1"].moe.experts.w1.shape == (4, 16, 32)
    assert model.layers["1"].moe.experts.w2.shape == (4, 32, 16)
    logits = model(torch.randint(0, 128, (2, 9)))
    assert logits.shape == (2, 9, 128)
    expected = model.layers["1"].moe.aux_loss + model.layers["2"].moe.aux_loss
    assert model.aux_loss().item() == pytest.approx(expected.item())
    # near-uniform router at init: the loss is close to its balanced value of coef * 1 per layer
    assert 0.02 <= model.aux_loss().item() < 0.03


def test_full_recompute_keeps_the_forward_aux_losses():
    """Recomputing a MoE block in the backward (full checkpointing) used to re-assign its aux
    loss, a second graph that kept every block's norm and attention activations alive until the
    next forward (11 GiB on Mixtral 8x7B); the forward's aux losses now stay as they were."""
    from fivefold.parallel.activation_checkpoint import apply_recompute

    torch.manual_seed(0)
    model = make(TINY_MOE.with_(layers=2))
    apply_recompute(model, "full")
    tokens = torch.randint(0, 128, (2, 9))
    loss = cross_entropy_loss(model(tokens), tokens) + model.aux_loss()
    kept = [moe.aux_loss for moe in model.moe_layers()]
    loss.backward()
    assert all(moe.aux_loss is aux for moe, aux in zip(model.moe_layers(), kept, strict=True))
    assert all(moe.router.weight.grad is not None for moe in model.moe_layers())


def test_moe_document_isolation_up_to_rounding():
    model = make(TINY_MOE)
    tokens = torch.randint(0, 128, (1, 20))
    docs = torch.tensor([[0] * 8 + [1] * 12])
    positions = torch.cat([torch.arange(8), torch.arange(12)]).unsqueeze(0)
    packed = model(tokens, positions, docs)
    alone = model(tokens[:, 8:])
    torch.testing.assert_close(packed[0, 8:], alone[0], atol=1e-5, rtol=1e-5)


def test_moe_model_overfits():
    torch.manual_seed(0)
    model = make(TINY_MOE)
    tokens = torch.randint(0, 128, (4, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        (loss + model.aux_loss()).backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(128), abs=0.1)
    assert losses[-1] < 0.3 * losses[0]


def _looped_swiglu(x, w1, w2, w3, counts):
    """The reference: one SwiGLU per expert over its group, in a Python loop."""
    outputs = []
    for expert, group in enumerate(torch.split(x, counts.tolist())):
        hidden = torch.nn.functional.silu(group @ w1[expert].T) * (group @ w3[expert].T)
        outputs.append(hidden @ w2[expert].T)
    return torch.cat(outputs)


@pytest.mark.parametrize(
    "counts,dim,hidden",
    [([3, 1, 4, 2], 8, 16), ([3, 0, 5, 2], 8, 16), ([0, 0, 10, 0], 8, 16), ([3, 0, 5, 2], 6, 10)],
)
def test_grouped_swiglu_equals_the_expert_loop(counts, dim, hidden):
    from fivefold.model.moe import grouped_swiglu

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    experts, rows = len(counts), int(counts.sum())
    leaves = [
        torch.randn(rows, dim, generator=g),
        torch.randn(experts, hidden, dim, generator=g),
        torch.randn(experts, dim, hidden, generator=g),
        torch.randn(experts, hidden, dim, generator=g),
    ]
    grad_out = torch.randn(rows, dim, generator=g)
    results = []
    for fn in (grouped_swiglu, _looped_swiglu):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = fn(*inputs, counts)
        out.backward(grad_out)
        results.append([out, *(t.grad for t in inputs)])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # a broadcast gradient (of a sum) is accepted too
    inputs = [t.clone().requires_grad_() for t in leaves]
    grouped_swiglu(*inputs, counts).sum().backward()
    assert inputs[1].grad.shape == leaves[1].shape


def _ops_of_grouped_swiglu(fake: bool) -> list[str]:
    """The grouped GEMM operators one fp32 forward and backward of the experts dispatches."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.model.moe import grouped_swiglu

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        counts = torch.tensor([3, 1, 4, 0])
        x = torch.randn(8, 8, requires_grad=True)
        w1, w3 = (torch.randn(4, 16, 8, requires_grad=True) for _ in range(2))
        w2 = torch.randn(4, 8, 16, requires_grad=True)
        with Ops() as ops:
            grouped_swiglu(x, w1, w2, w3, counts).sum().backward()
    return [name for name in ops.names if "grouped_mm" in name]


def test_fp32_experts_take_the_same_grouped_gemm_under_fake_tensors():
    """A dry run (fake tensors) must take the path the run takes: the grouped GEMM in fp32,
    although torch's shape function of `_grouped_mm` accepts bf16 only."""
    real = _ops_of_grouped_swiglu(fake=False)
    assert real == ["fivefold.grouped_mm"] * (3 + 6)  # 3 projections, 2 gradients each
    assert _ops_of_grouped_swiglu(fake=True) == real
