"""Context parallelism (ring, all-gather, Ulysses) against the single-process attention.

One group of 4 gloo ranks runs every case (cp = 2 on two pairs of ranks, cp = 4 on all) and
reports the max absolute deviation of the output and of dq, dk, dv from the dense-mask reference
(`attention_reference.dense_reference_attention`) run on the full sequence; then a whole tiny
model with CP swapped in is compared with the single-process model on logits and parameter
gradients, and the ring's per-forward caching is checked (one doc-id all-gather per forward).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from attention_reference import dense_reference_attention, packed_doc_ids, positions_from_docs
from fivefold.model import DocumentLayout, build_model, cross_entropy_loss, document_blocks
from fivefold.parallel.context_parallel import (
    apply_context_parallel,
    load_balanced_indices,
    shard_batch_for_cp,
    shard_sequence_for_cp,
    unshard_sequence_for_cp,
)
from fivefold.specs.model import ModelSpec
from fivefold.train.data import Batch

WORLD = 4
TOL = 2e-5  # fp32; the measured deviations are ~1e-7
B, HQ, HKV, T, DH = 2, 4, 2, 32, 8
KINDS = ["ring", "allgather", "ulysses"]


def _attention_case(
    group, cp_rank, cp_size, kind, with_docs, dtype=torch.float32, window: int = 0
) -> float:
    """Max |deviation| of out, dq, dk, dv from the fp32 dense reference (inputs in dtype),
    within a sliding window of `window` keys when > 0."""
    g = torch.Generator().manual_seed(1234)
    q, k, v = (
        torch.randn(B, heads, T, DH, generator=g).to(dtype).float().requires_grad_()
        for heads in (HQ, HKV, HKV)
    )
    dout = torch.randn(B, HQ, T, DH, generator=g)
    docs = packed_doc_ids(B, T, g) if with_docs else None
    ref = dense_reference_attention(q, k, v, docs, window)
    ref.backward(dout)

    def shard(x):
        return shard_sequence_for_cp(x.detach(), cp_rank, cp_size, dim=2)

    lq, lk, lv = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    local_docs = None if docs is None else shard_sequence_for_cp(docs, cp_rank, cp_size, dim=1)
    from fivefold.parallel.context_parallel import ContextParallelAttentionCore

    core = ContextParallelAttentionCore(group, kind, window)
    layout = None if local_docs is None else DocumentLayout(local_docs, B, T // cp_size)
    out = core(lq, lk, lv, layout)
    out.backward(shard(dout).to(dtype))
    pairs = [(out, ref), (lq.grad, q.grad), (lk.grad, k.grad), (lv.grad, v.grad)]
    return max((a.float() - shard(b)).abs().max().item() for a, b in pairs)


TINY = ModelSpec(
    name="tiny-cp", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=97, seq_len=T
)
WINDOW = 5  # keys per query: shorter than a CP chunk (T / 2cp = 4 or 8 tokens) and longer
# TINY with the window in its first layer only: a full and a windowed layer in one model
TINY_WINDOWED = TINY.with_(sliding_window=WINDOW, sliding_pattern="sf")


def _model_case(group, cp_rank, cp_size, kind, spec=TINY) -> tuple[float, int]:
    """(max deviation of local logits and of CP-summed parameter grads from the full model,
    doc-id all-gathers during the CP model's forward and backward)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab, (B, T + 1), generator=g)
    docs = packed_doc_ids(B, T, g)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], positions_from_docs(docs), docs)

    ref = build_model(spec)
    ref.to_empty(device="cpu")
    ref.init_weights(seed=0)
    ref_logits = ref(batch.tokens, batch.positions, batch.doc_ids)
    cross_entropy_loss(ref_logits, batch.labels).backward()

    model = build_model(spec)
    apply_context_parallel(model, group, kind)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    local = shard_batch_for_cp(batch, cp_rank, cp_size)
    gathers, real_all_gather = [0], dist.all_gather

    def counting_all_gather(*args, **kwargs):
        gathers[0] += 1
        return real_all_gather(*args, **kwargs)

    dist.all_gather = counting_all_gather
    try:
        logits = model(local.tokens, local.positions, local.doc_ids)
        loss = cross_entropy_loss(logits, local.labels, reduction="sum") / batch.labels.numel()
        loss.backward()
    finally:
        dist.all_gather = real_all_gather
    deviation = (logits - shard_sequence_for_cp(ref_logits.detach(), cp_rank, cp_size)).abs().max()
    for (name, p), (ref_name, ref_p) in zip(
        model.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert name == ref_name
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        deviation = torch.maximum(deviation, (grad - ref_p.grad).abs().max())
    return deviation.item(), gathers[0]


def _cp_worker() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    results = {}
    for cp_size, group in groups.items():
        cp_rank = dist.get_rank(group)
        for kind in KINDS:
            for with_docs in (False, True):
                key = f"attn-{kind}-cp{cp_size}-docs{int(with_docs)}"
                results[key] = _attention_case(group, cp_rank, cp_size, kind, with_docs)
            key = f"attn-{kind}-cp{cp_size}-window"
            results[key] = _attention_case(group, cp_rank, cp_size, kind, True, window=WINDOW)
        results[f"attn-ring-bf16-cp{cp_size}"] = _attention_case(
            group, cp_rank, cp_size, "ring", True, torch.bfloat16
        )
        results[f"model-ring-cp{cp_size}-window"] = _model_case(
            group, cp_rank, cp_size, "ring", TINY_WINDOWED
        )[0]
        for kind in ("ring", "allgather", "ulysses"):
            if kind == "ulysses" and TINY.heads % cp_size:
                continue
            deviation, gathers = _model_case(group, cp_rank, cp_size, kind)
            results[f"model-{kind}-cp{cp_size}"] = deviation
            results[f"gathers-{kind}-cp{cp_size}"] = gathers
    return results


@pytest.fixture(scope="module")
def deviations() -> dict:
    per_rank = run_ranks(WORLD, _cp_worker, timeout_s=240)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_forward_backward_matches_dense_reference(deviations, kind, cp, with_docs):
    deviation = deviations[f"attn-{kind}-cp{cp}-docs{int(with_docs)}"]
    assert deviation < TOL, f"{kind} cp={cp}: max |dev| {deviation:.3g}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_windowed_attention_matches_dense_reference(deviations, kind, cp):
    """A sliding window of 5 keys over packed documents, forward and backward, every CP kind."""
    deviation = deviations[f"attn-{kind}-cp{cp}-window"]
    assert deviation < TOL, f"{kind} cp={cp} window: max |dev| {deviation:.3g}"


@pytest.mark.parametrize("cp", [2, 4])
def test_windowed_model_with_ring_matches_single_process(deviations, cp):
    deviation = deviations[f"model-ring-cp{cp}-window"]
    assert deviation < TOL, f"windowed model ring cp={cp}: max |dev| {deviation:.3g}"


def test_ring_steps_outside_the_window_have_no_blocks():
    """cp = 4, chunks of 4 tokens, one document: rank 3 holds chunks 3 and 4 (tokens 12-15,
    16-19). With a window of 5 keys its queries reach back 4 tokens, so they meet only the
    chunk just before each of theirs (2 before 3; 3, its own, before 4): of rank 2's chunks
    (2, 5) one block is left, and the ring steps bringing ranks 1 and 0's chunks (1, 6 and
    0, 7) have none; without the window every earlier chunk is a block."""
    from fivefold.parallel.context_parallel import local_chunks

    layout = DocumentLayout(None, 1, 32)
    mine = local_chunks(3, 4, 4)
    per_step = {
        window: [
            len(document_blocks(mine, local_chunks((3 - step) % 4, 4, 4), layout, window))
            for step in range(4)
        ]
        for window in (0, WINDOW)
    }
    # steps bring ranks 3, 2, 1, 0: (chunks 3, 4), (2, 5), (1, 6), (0, 7)
    assert per_step[0] == [3, 2, 2, 2]
    assert per_step[WINDOW] == [3, 1, 0, 0]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_bf16_stays_close_to_fp32_reference(deviations, cp):
    deviation = deviations[f"attn-ring-bf16-cp{cp}"]
    assert deviation < 5e-2, f"bf16 ring cp={cp}: max |dev| {deviation:.3g}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", ["ring", "allgather", "ulysses"])
def test_model_with_context_parallel_matches_single_process(deviations, kind, cp):
    deviation = deviations[f"model-{kind}-cp{cp}"]
    assert deviation < TOL, f"model {kind} cp={cp}: max |dev| {deviation:.3g}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kind", ["ring", "allgather", "ulysses"])
def test_doc_ids_are_gathered_once_per_forward_not_per_layer(deviations, kind, cp):
    assert deviations[f"gathers-{kind}-cp{cp}"] == 1  # TINY has 2 layers


def test_load_balanced_layout_covers_sequence_with_equal_causal_work():
    cp, seq = 4, 32
    shares = [load_balanced_indices(seq, r, cp) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shares)).values, torch.arange(seq))
    # causal work of a rank = sum over its queries of (index + 1) keys; equal for every rank
    work = [int((s + 1).sum()) for s in shares]
    assert work == [work[0]] * cp and work[0] == seq * (seq + 1) // 2 // cp
    assert shares[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]


def test_shard_batch_round_trips():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 100, (2, 16), generator=g)
    docs = packed_doc_ids(2, 16, g)
    batch = Batch(x, x + 1, positions_from_docs(docs), docs)
    shards = [shard_batch_for_cp(batch, r, 2) for r in range(2)]
    for field in ("tokens", "labels", "positions", "doc_ids"):
        rebuilt = unshard_sequence_for_cp([getattr(s, field) for s in shards])
        assert torch.equal(rebuilt, getattr(batch, field))
    assert shards[0].tokens.shape == (2, 8)
    assert torch.equal(shards[1].positions[:, :4], batch.positions[:, 4:8])
