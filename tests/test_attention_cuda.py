"""The CUDA attention paths without a GPU: which kernel runs packed documents where, the
FlexAttention document mask (tiles hand-derived, numerics against the per-document reference on
CPU, built on fake CUDA tensors), the compiled path traced whole (no graph break, no
`document_attention` op, no K/V copies, no recompile per packing), and `varlen_attn`'s GQA."""

from __future__ import annotations

import warnings
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fivefold.model.attention as attention
from fivefold.model.attention import (
    AttentionCore,
    document_attention,
    flex_document_attention,
    packed_kernel,
)
from fivefold.model.document_layout import DocumentLayout, flex_tiles
from fivefold.model.torch_features import varlen_supports_gqa

CUDA = torch.device("cuda:0")  # fake tensors need the index (no CUDA runtime to resolve it)
B, HQ, HKV, T, DH = 2, 4, 2, 384, 16


def _ids(*rows: list[int]) -> torch.Tensor:
    """doc_ids [len(rows), sum(lengths)] from each row's document lengths."""
    return torch.tensor([np.repeat(np.arange(len(r)), r).tolist() for r in rows])


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():  # eager FlexAttention warns that it is unfused
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def test_packed_documents_kernel_per_device_and_mode():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert packed_kernel(CUDA, bf16, compiling=True) == "flex"
    assert packed_kernel(CUDA, fp32, compiling=True) == "flex"
    assert packed_kernel(CUDA, bf16, compiling=False) == "varlen"
    assert packed_kernel(CUDA, fp32, compiling=False) == "document_attention"
    for compiling in (False, True):
        assert packed_kernel(torch.device("cpu"), bf16, compiling) == "document_attention"


def test_flex_tiles_hand_derived():
    # T = 8 in tiles of 2: documents [0, 3) and [3, 8); tiles 0:[0,2) 1:[2,4) 2:[4,6) 3:[6,8)
    partial, full = flex_tiles((0, 3), 8, block=2)
    # tile 1 straddles the boundary: it meets tile 0 (doc 0) and itself; tiles 2 and 3 lie in
    # doc 1, which tile 1 reaches, so they meet it partially and each other fully below the
    # diagonal; tile 0 never meets tiles 2, 3 (doc 0 ends in tile 1)
    assert partial.astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 1, 0, 1],
    ]
    assert full.astype(int).tolist() == [
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 1, 0],
    ]
    # one document: the causal staircase, the diagonal partial and everything below full
    partial, full = flex_tiles((0,), 6, block=2)
    assert (partial == np.eye(3, dtype=bool)).all()
    assert (full == np.tri(3, k=-1, dtype=bool)).all()


def test_windowed_flex_tiles_hand_derived():
    # one document of 8 tokens in tiles of 2, a window of 3 keys (query i sees i-2..i): tile i
    # meets tile j when j's last key (2j+1) > i's first query (2i) - 3, i.e. j >= i - 1; none
    # is full, since i's last query (2i+1) sees back to 2i-1, short of tile i-1's first key
    partial, full = flex_tiles((0,), 8, block=2, window=3)
    assert partial.astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]
    assert not full.any()
    # a window of 5: tile i's last query (2i+1) sees back to 2i-3 = tile i-1's first key, so
    # tile i-1 is full; tile i-2 (keys 2i-4, 2i-3) still meets i's first query (sees 2i-4)
    partial, full = flex_tiles((0,), 8, block=2, window=5)
    assert (partial | full).astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 1, 1, 1],
    ]
    assert full.astype(int).tolist() == [
        [0, 0, 0, 0],
        [1, 0, 0, 0],
        [0, 1, 0, 0],
        [0, 0, 1, 0],
    ]


@pytest.mark.parametrize("window", [40, 200])
def test_windowed_flex_matches_the_windowed_document_op_on_cpu(window):
    """A window shorter and longer than a tile (128), documents across tile edges."""
    torch.manual_seed(0)
    ids = _ids([50, 300, 34], [384])
    docs = DocumentLayout(ids, 2, T)
    q, k, v = torch.randn(2, HQ, T, DH), torch.randn(2, HKV, T, DH), torch.randn(2, HKV, T, DH)
    out = flex_document_attention(q, k, v, docs, window)
    reference = document_attention(q, k, v, ids, window)[0]
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(out, document_attention(q, k, v, ids)[0], atol=1e-3)


@pytest.mark.parametrize("gqa", [True, False])
def test_flex_block_mask_matches_per_document_reference_on_cpu(gqa):
    torch.manual_seed(0)
    ids = _ids([50, 300, 34], [128, 128, 128], [384])  # boundaries inside and on tile edges
    docs = DocumentLayout(ids, 3, T)
    heads_kv = HKV if gqa else HQ
    q = torch.randn(3, HQ, T, DH)
    k, v = torch.randn(3, heads_kv, T, DH), torch.randn(3, heads_kv, T, DH)
    out = flex_document_attention(q, k, v, docs)
    reference = document_attention(q, k, v, ids)[0]
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)
    assert docs.flex_block_mask(q.device) is docs.flex_block_mask(q.device)  # once per batch


def test_flex_block_mask_built_on_fake_cuda_before_the_compiled_block():
    from fivefold.parallel.compile import _read_documents

    docs = DocumentLayout(_ids([100, 284], [384]), B, T)
    docs.single_document  # noqa: B018 (read on the host from the real ids, then faked)
    with FakeTensorMode(allow_non_fake_inputs=True):
        docs.doc_ids = torch.zeros(B, T, dtype=torch.long, device=CUDA)
        x = torch.randn(B, T, 32, device=CUDA, dtype=torch.bfloat16)
        _read_documents(None, (x, None, docs))  # the compiled block's pre-hook
        windowed = SimpleNamespace(attention=SimpleNamespace(window=64))
        _read_documents(windowed, (x, None, docs))  # a layer sliding over 64 keys
    assert docs.cache[("flex", str(CUDA), 64)].kv_indices.shape == (B, 1, 3, 3)
    mask = docs.cache[("flex", str(CUDA), 0)]  # no window
    assert mask.kv_num_blocks.device == CUDA and mask.q_indices.device == CUDA
    assert mask.kv_indices.shape == (B, 1, 3, 3) and mask.BLOCK_SIZE == (128, 128)
    assert not docs.single_document


def _capture_backend(graphs: list):
    """An aot_eager backend that keeps every forward graph it is given."""
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def test_compiled_packed_attention_is_one_graph_without_document_op(monkeypatch):
    """The compiled CUDA path, traced on CPU (CUDA's kernel needs a GPU, and fake CUDA tensors
    cannot run FlexAttention's meta function on a CPU-only torch): `packed_kernel` answers as
    on CUDA under compile, and dynamo with fullgraph=True traces one graph with one flex
    attention node, no `document_attention`, no K/V head copies; a new packing reuses it."""
    real = packed_kernel
    monkeypatch.setattr(
        attention,
        "packed_kernel",
        lambda d, t, compiling: "flex" if compiling else real(d, t, compiling),
    )
    torch._dynamo.reset()
    graphs: list = []
    core = torch.compile(AttentionCore(), fullgraph=True, backend=_capture_backend(graphs))
    torch.manual_seed(0)
    for rows in (([100, 284], [384]), ([7, 200, 177], [300, 84])):
        ids = _ids(*rows)
        docs = DocumentLayout(ids, B, T)
        docs.single_document  # noqa: B018 (the pre-hook's eager reads)
        docs.flex_block_mask(torch.device("cpu"))
        q = torch.randn(B, T, HQ, DH).transpose(1, 2)
        k, v = (torch.randn(B, T, HKV, DH).transpose(1, 2) for _ in range(2))
        out = core(q, k, v, docs)
        torch.testing.assert_close(out, document_attention(q, k, v, ids)[0], atol=2e-6, rtol=1e-5)
    assert len(graphs) == 1  # the second packing neither recompiled nor broke the graph
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("flex_attention" in t for t in targets)
    assert not any("document_attention" in t for t in targets)
    assert not any("repeat" in t or "expand" in t for t in targets)  # GQA without K/V copies


def test_compiled_block_dispatches_flex_on_cuda(monkeypatch):
    """On CUDA under compile the core calls FlexAttention with native GQA (no copies) and the
    layer's window."""
    seen = {}

    def fake_flex(q, k, v, docs, window=0):
        seen.update(q=q.shape, k=k.shape, window=window)
        return q

    monkeypatch.setattr(attention, "flex_document_attention", fake_flex)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    docs = DocumentLayout(_ids([100, 284], [384]), B, T)
    docs.single_document  # noqa: B018
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(B, HQ, T, DH, device=CUDA, dtype=torch.bfloat16)
        kv = torch.randn(B, HKV, T, DH, device=CUDA, dtype=torch.bfloat16)
        AttentionCore(64)(q, kv, kv, docs)  # a layer with a sliding window of 64 keys
    assert seen == {"q": (B, HQ, T, DH), "k": (B, HKV, T, DH), "window": 64}


@pytest.mark.parametrize("has_gqa", [True, False])
def test_varlen_gqa_follows_the_installed_torch(monkeypatch, has_gqa):
    """Eager CUDA: `enable_gqa=True` where `varlen_attn` takes it (2.13), K/V heads repeated
    where it does not (2.11: the call that crashed on the H200)."""
    import torch.nn.attention.varlen as varlen

    calls = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, **gqa):
        calls.update(k_heads=k.shape[1], gqa=gqa, window=window_size)
        return torch.empty_like(q)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen)
    monkeypatch.setattr(attention, "varlen_supports_gqa", lambda: has_gqa)
    docs = DocumentLayout(_ids([100, 284], [384]), B, T)
    docs.single_document  # noqa: B018
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(B, T, HQ, DH, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.randn(B, T, HKV, DH, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
        out = AttentionCore()(q, kv, kv, docs)
    assert out.shape == (B, HQ, T, DH) and calls["window"] == (-1, 0)
    if has_gqa:
        assert calls == {"k_heads": HKV, "gqa": {"enable_gqa": True}, "window": (-1, 0)}
    else:
        assert calls["k_heads"] == HQ and calls["gqa"] == {}


@pytest.mark.parametrize("packed", [True, False])
def test_varlen_takes_the_layers_window(monkeypatch, packed):
    """Eager CUDA bf16 with a window of 64 keys: flash's own window, 63 keys back and none
    ahead, for packed documents and for one document per row (one sequence per row)."""
    import torch.nn.attention.varlen as varlen

    calls = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, **gqa):
        calls.update(window=window_size, sequences=cu_q.numel() - 1)
        return torch.empty_like(q)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen)
    # not read from the fake's signature (the answer is cached for the installed torch)
    monkeypatch.setattr(attention, "varlen_supports_gqa", lambda: True)
    docs = DocumentLayout(_ids([100, 284], [384]), B, T) if packed else None
    if packed:
        docs.single_document  # noqa: B018
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(B, T, HQ, DH, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.randn(B, T, HKV, DH, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
        AttentionCore(64)(q, kv, kv, docs)
    assert calls == {"window": (63, 0), "sequences": 3 if packed else B}


def test_varlen_gqa_detected_from_the_signature():
    from torch.nn.attention.varlen import varlen_attn

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 13):
        assert varlen_supports_gqa()
    assert varlen_supports_gqa() is ("enable_gqa" in varlen_attn.__code__.co_varnames)


# ---- context parallelism's blocks on CUDA ------------------------------------------------------
def _ring_blocks(ids: torch.Tensor, cp: int = 2):
    """Rank 0's blocks of load-balanced CP over `cp` ranks: (q chunks local, all chunks)."""
    from fivefold.parallel.context_parallel import local_chunks, rank_order_chunks

    batch, seq = ids.shape
    chunk = seq // (2 * cp)
    docs = DocumentLayout(ids, batch, seq)
    mine = local_chunks(0, cp, chunk)
    return docs, mine, rank_order_chunks(cp, chunk)


def test_varlen_sequences_hand_derived():
    # one row, documents [0, 3) and [3, 8); queries 4..7 (doc 1) against keys 0..3: doc 0's keys
    # 0..2 have no queries, doc 1's key 3 meets all four queries (full, keys precede)
    from fivefold.model.attention_blocks import varlen_sequences
    from fivefold.model.document_layout import Chunk, document_blocks

    docs = DocumentLayout(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]), 1, 8)
    (off,) = document_blocks([Chunk(0, 4, 4)], [Chunk(0, 0, 4)], docs)
    assert varlen_sequences(off.spans, 1, 4, 4) == ((0, 0, 4), (0, 3, 4))
    # two rows: [0,2)+[2,6) and [0,6); queries 0..5 against themselves (causal, diagonal)
    two = DocumentLayout(torch.tensor([[0, 0, 1, 1, 1, 1], [0] * 6]), 2, 6)
    (diag,) = document_blocks([Chunk(0, 0, 6)], [Chunk(0, 0, 6)], two)
    assert varlen_sequences(diag.spans, 2, 6, 6) == ((0, 2, 6, 12),) * 2
    # queries 3..5 against keys 0..2: row 0 doc 1 (keys 2, queries 3..5) after doc 0's keys
    # 0..1 alone; row 1 one document
    (past,) = document_blocks([Chunk(0, 3, 3)], [Chunk(0, 0, 3)], two)
    assert varlen_sequences(past.spans, 2, 3, 3) == ((0, 0, 3, 6), (0, 2, 3, 6))


def _varlen_reference(q, k, v, cu_q, cu_k, causal):
    """Attention of each varlen sequence on its own keys (SDPA per sequence, CPU): packed
    q [Nq, Hq, Dh], k, v [Nk, Hkv, Dh] -> (out [Nq, Hq, Dh], lse [Hq, Nq]; 0 and -inf without
    keys)."""
    out = q.new_zeros(q.shape)
    lse = q.new_full((q.shape[1], q.shape[0]), -torch.inf)
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q), pairwise(cu_k), strict=True):
        if q1 > q0 and k1 > k0:
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
            scores = qs @ ks.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
            scores = scores * q.shape[-1] ** -0.5
            if causal:
                scores = scores.masked_fill(torch.ones_like(scores, dtype=bool).triu(1), -torch.inf)
            lse[:, q0:q1] = scores.logsumexp(-1)[0]
            out[q0:q1] = (scores.softmax(-1) @ vs.repeat_interleave(2, 1))[0].transpose(0, 1)
    return out, lse


def test_ring_block_sequences_equal_the_span_kernel_on_cpu():
    """What one flash varlen call computes per block, emulated on CPU from the block's
    sequences, equals the per-span CPU kernel: output and log-sum-exp, every block of a
    load-balanced CP rank over three rows of packed documents."""
    from fivefold.model.attention_blocks import block_forward, varlen_sequences
    from fivefold.model.document_layout import document_blocks

    torch.manual_seed(0)
    ids = _ids([5, 30, 13], [48], [20, 4, 24])
    docs, mine, every = _ring_blocks(ids, cp=2)
    q = torch.randn(3, 24, HQ, DH).transpose(1, 2)  # rank 0's 24 tokens: chunks 0 and 3
    k, v = (torch.randn(3, 48, HKV, DH).transpose(1, 2) for _ in range(2))
    blocks = document_blocks(mine, every, docs)
    assert {b.spans[0].causal for b in blocks} == {True, False}
    for block in blocks:
        qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
        cu_q, cu_k = varlen_sequences(block.spans, 3, qb.shape[2], kb.shape[2])
        packed = [x.transpose(1, 2).reshape(-1, x.shape[1], DH) for x in (qb, kb, vb)]
        out, lse = _varlen_reference(*packed, cu_q, cu_k, block.spans[0].causal)
        want_out, want_lse = block_forward(q, k, v, block, DH**-0.5)
        b, h, t = want_lse.shape
        torch.testing.assert_close(out.view(b, t, h, DH).transpose(1, 2), want_out)
        torch.testing.assert_close(lse.view(h, b, t).transpose(0, 1), want_lse)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops that run (names), passing each through."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_ring_blocks_on_cuda_one_flash_call_per_block_gqa_native_grads_summed_in_fp32():
    from fivefold.model.attention_blocks import (
        _device_offsets,
        block_backward,
        block_forward,
        zero_grads,
    )
    from fivefold.model.document_layout import document_blocks

    ids = _ids([5, 30, 13], [48])
    docs, mine, every = _ring_blocks(ids, cp=2)
    blocks = document_blocks(mine, every, docs)
    _device_offsets.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        bf16 = dict(device=CUDA, dtype=torch.bfloat16)
        q = torch.randn(2, 24, HQ, DH, **bf16).transpose(1, 2)
        k, v = (torch.randn(2, 48, HKV, DH, **bf16).transpose(1, 2) for _ in range(2))
        with _OpLog() as forward:  # the blocks one by one (fake CUDA cannot run the merge's
            # indexing on a CPU-only torch; the merge is the CPU path's, checked above)
            outs = [block_forward(q, k, v, block, DH**-0.5) for block in blocks]
        out = torch.randn(2, 24, HQ, DH, **bf16).transpose(1, 2)  # the merged results
        lse = torch.randn(2, HQ, 24, device=CUDA)
        grads = zero_grads(q, k)
        with _OpLog() as backward:
            for block in blocks:
                block_backward(out, q, k, v, out, lse, block, DH**-0.5, grads)
    _device_offsets.cache_clear()
    assert len(blocks) == 5  # chunk 0 on itself; chunk 3 on chunks 0, 1, 2 and on itself
    for block, (block_out, block_lse) in zip(blocks, outs, strict=True):
        rows = block.q.stop - block.q.start
        assert block_out.shape == (2, HQ, rows, DH) and block_out.dtype == torch.bfloat16
        assert block_lse.shape == (2, HQ, rows) and block_lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32] * 3  # bf16 block results, fp32 sums
    assert grads[1].shape == (2, HKV, 48, DH)
    assert forward.ops.count("_flash_attention_forward.default") == len(blocks)
    assert backward.ops.count("_flash_attention_backward.default") == len(blocks)
    for log in (forward.ops, backward.ops):
        assert not any("efficient" in op or "repeat" in op or "expand" in op for op in log)
