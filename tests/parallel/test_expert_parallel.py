"""Expert parallelism against the single-process MoE model.

Each EP rank feeds its own batch; the reference is the full model (all experts, local
dispatcher) on the union of the group's batches. Logits, the load-balancing loss, the
non-expert gradients (averaged over the group) and every rank's expert-shard gradients must match.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from fivefold.model import build_model, cross_entropy_loss
from fivefold.parallel.expert_parallel import (
    AllToAllDispatcher,
    ShardedExperts,
    apply_expert_parallel,
    expert_parameters,
)
from fivefold.specs.model import ModelSpec

WORLD = 4
TOL = 1e-5
B, T = 2, 16
MOE = ModelSpec(
    name="tiny-moe-ep", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=97, seq_len=T,
    experts=4, top_k=2, expert_ffn=16, shared_experts=1, dense_layers=0,
    router_aux_loss_coef=0.1,
)  # fmt: skip


def _rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, MOE.vocab, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _ep_case(group, ep_rank: int, ep: int, global_ranks: list[int], init_after: bool) -> dict:
    import torch.distributed as dist

    batches = [_rank_batch(r) for r in global_ranks]
    ref = build_model(MOE)
    ref.to_empty(device="cpu")
    ref.init_weights(seed=0)
    all_tokens = torch.cat([t for t, _ in batches])
    all_labels = torch.cat([lab for _, lab in batches])
    ref_logits = ref(all_tokens)
    ref_aux = ref.aux_loss()
    (cross_entropy_loss(ref_logits, all_labels) + ref_aux).backward()

    model = build_model(MOE)
    if init_after:  # the usual order: parallelise on meta, then materialise and initialise
        apply_expert_parallel(model, group)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
    else:
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        apply_expert_parallel(model, group)
    tokens, labels = batches[ep_rank]
    logits = model(tokens)
    aux = model.aux_loss()
    (cross_entropy_loss(logits, labels) + aux).backward()

    out = {
        "logits": (logits - ref_logits[ep_rank * B : (ep_rank + 1) * B]).abs().max().item(),
        "aux": abs(aux.item() - ref_aux.item()),
        "aux_value": aux.item(),
    }
    expert_names = {name for name, _ in expert_parameters(model)}
    ref_params = dict(ref.named_parameters())
    dense_dev, expert_dev = 0.0, 0.0
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        if name in expert_names:
            local = p.grad.to_local()
            per = local.shape[0]
            ref_slice = ref_grad[ep_rank * per : (ep_rank + 1) * per]
            expert_dev = max(expert_dev, (local - ref_slice).abs().max().item())
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            dense_dev = max(dense_dev, (grad / ep - ref_grad).abs().max().item())
    out["dense_grads"], out["expert_grads"] = dense_dev, expert_dev
    out["n_expert_params"] = len(expert_names)
    return out


def _ep_worker() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cases = {
        2: (pairs[rank // 2], [0, 1] if rank < 2 else [2, 3]),
        4: (dist.group.WORLD, [0, 1, 2, 3]),
    }
    results = {}
    for ep, (group, members) in cases.items():
        for init_after in (True, False):
            case = _ep_case(group, dist.get_rank(group), ep, members, init_after)
            for key, value in case.items():
                results[f"ep{ep}-init_after{int(init_after)}-{key}"] = value
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(WORLD, _ep_worker, timeout_s=240)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("init_after", [True, False])
@pytest.mark.parametrize("quantity", ["logits", "aux", "dense_grads", "expert_grads"])
def test_expert_parallel_matches_local_moe(per_rank, ep, init_after, quantity):
    key = f"ep{ep}-init_after{int(init_after)}-{quantity}"
    deviation = max(r[key] for r in per_rank)
    assert deviation < TOL, f"EP{ep} {quantity}: max |dev| {deviation:.3g}"


def test_aux_loss_is_the_same_on_every_rank_and_not_trivial(per_rank):
    values = [r["ep4-init_after1-aux_value"] for r in per_rank]
    assert max(values) - min(values) < 1e-7
    # coef 0.1 * 2 layers * (E sum f P >= 1 with equality only at perfect balance)
    assert values[0] >= 0.2 - 1e-6
    assert all(r["ep4-init_after1-n_expert_params"] == 2 * 3 for r in per_rank)


def _meta_swap_worker() -> dict:
    import torch.distributed as dist

    model = apply_expert_parallel(build_model(MOE), dist.group.WORLD)
    moe = model.layers["0"].moe
    return {
        "dispatcher": type(moe.dispatcher).__name__,
        "experts": type(moe.experts).__name__,
        "w1_shape": tuple(moe.experts.w1.shape),
        "w1_meta": moe.experts.w1.is_meta,
    }


def test_apply_replaces_dispatcher_and_experts_on_meta():
    (result,) = run_ranks(1, _meta_swap_worker, timeout_s=60)
    assert result == {
        "dispatcher": AllToAllDispatcher.__name__,
        "experts": ShardedExperts.__name__,
        "w1_shape": (MOE.experts, MOE.expert_ffn, MOE.hidden),
        "w1_meta": True,
    }


def _combine_saved_worker() -> dict:
    """Bytes autograd saves in the EP dispatcher's combine over 2 ranks: N = 24 tokens of
    width D = 8, top-2 of 4 experts, floating-point tensors only."""
    import torch.distributed as dist

    from fivefold.model.routers import route

    torch.manual_seed(dist.get_rank())
    n, d, k = 24, 8, 2
    dispatcher = AllToAllDispatcher(dist.group.WORLD)
    tokens = torch.randn(n, d, requires_grad=True)
    routing = route(torch.randn(n, 4, requires_grad=True), k)
    grouped, _, handle = dispatcher.dispatch(tokens, routing)
    expert_out = grouped * 2.0  # a product by a number saves nothing
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dispatcher.combine(expert_out, handle)
    out.sum().backward()
    return {"saved": sum(saved), "slots_and_gates": n * k * d * 4 + n * k * 4}


def test_combine_saves_only_the_gate_product_inputs():
    # The gate-weighted sum keeps the K copies of each token and the gates; reordering the
    # returned copies (a gather by the inverse permutation) keeps only indices. An out-of-place
    # `index_copy` kept its whole source: the experts' output and the returned copies, two
    # more N x K x D per MoE layer under EP.
    for result in run_ranks(2, _combine_saved_worker, timeout_s=60):
        assert result["saved"] == result["slots_and_gates"]
