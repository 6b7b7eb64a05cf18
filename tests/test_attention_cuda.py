"""The CUDA attention paths without a GPU: which kernel runs packed documents where, the
FlexAttention document mask (tiles hand-derived, numerics against the per-document reference on
CPU, built on fake CUDA tensors), the compiled path traced whole (no graph break, no
`document_attention` op, no K/V copies, no recompile per packing), and `varlen_attn`'s GQA."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fivefold.model.attention as attention
from fivefold.model.attention import (
    AttentionCore,
    DocumentLayout,
    document_attention,
    flex_document_attention,
    flex_tiles,
    packed_kernel,
    varlen_has_gqa,
)

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
    mask = docs.cache[("flex", str(CUDA))]
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
    """On CUDA under compile the core calls FlexAttention with native GQA (no copies)."""
    seen = {}

    def fake_flex(q, k, v, docs):
        seen.update(q=q.shape, k=k.shape)
        return q

    monkeypatch.setattr(attention, "flex_document_attention", fake_flex)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    docs = DocumentLayout(_ids([100, 284], [384]), B, T)
    docs.single_document  # noqa: B018
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(B, HQ, T, DH, device=CUDA, dtype=torch.bfloat16)
        kv = torch.randn(B, HKV, T, DH, device=CUDA, dtype=torch.bfloat16)
        AttentionCore()(q, kv, kv, docs)
    assert seen == {"q": (B, HQ, T, DH), "k": (B, HKV, T, DH)}


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
    monkeypatch.setattr(attention, "varlen_has_gqa", lambda: has_gqa)
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


def test_varlen_gqa_detected_from_the_signature():
    from torch.nn.attention.varlen import varlen_attn

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 13):
        assert varlen_has_gqa()
    assert varlen_has_gqa() is ("enable_gqa" in varlen_attn.__code__.co_varnames)
