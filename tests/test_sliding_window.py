"""Sliding-window attention on one process: which layers slide (`ModelSpec.layer_window`), the
spans trimmed to the window (hand-derived), and the attention core (one document per row:
SDPA with the band; packed documents: the `document_attention` op) against the dense-mask
reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from attention_reference import dense_reference_attention, packed_doc_ids
from fivefold.model.attention import AttentionCore
from fivefold.model.document_layout import Chunk, DocumentLayout, document_blocks
from fivefold.model.sliding_window import window_span
from fivefold.specs.model import ModelSpec

B, HQ, HKV, T, DH = 2, 4, 2, 40, 8


def test_which_layers_slide():
    base = ModelSpec(layers=6, sliding_window=16)
    assert [base.layer_window(i) for i in range(6)] == [16] * 6  # Mistral: every layer
    last = base.with_(sliding_layers=2)  # Qwen: from max_window_layers on
    assert [last.layer_window(i) > 0 for i in range(6)] == [False] * 4 + [True] * 2
    alternating = base.with_(sliding_pattern="sf")
    assert [alternating.layer_window(i) > 0 for i in range(6)] == [True, False] * 3
    five_to_one = base.with_(sliding_pattern="sssssf")
    assert five_to_one.windowed_layers == 5
    assert ModelSpec(layers=6).windowed_layers == 0
    assert "sliding_pattern and model.sliding_layers" in " ".join(
        base.with_(sliding_pattern="sf", sliding_layers=2).problems()
    )


def test_window_span_hand_derived():
    # the diagonal [0, 10) with a window of 4: nothing trimmed, the band needs a mask
    assert window_span(0, 10, 0, 10, 4) == (0, 10, 0, 10, True)
    # a diagonal no longer than the window: plain causal
    assert window_span(0, 4, 0, 4, 4) == (0, 4, 0, 4, False)
    # queries [10, 20) on keys [0, 10), window 4: keys from 10 - 3 = 7, queries before
    # 10 + 3 = 13 (query 12 sees 9); 12 - 7 = 5 >= 4, so still a mask
    assert window_span(10, 20, 0, 10, 4) == (10, 13, 7, 10, True)
    # keys [0, 4) and queries [20, 30): wholly outside the window
    assert window_span(20, 30, 0, 4, 4) is None
    # a window wider than both: untouched, no mask
    assert window_span(10, 20, 0, 10, 100) == (10, 20, 0, 10, False)


def test_blocks_skip_what_the_window_leaves_out():
    """Queries 16-23 against key chunks 0-7 and 8-15, a window of 4 (query i sees i-3..i)."""
    layout = DocumentLayout(None, 1, 32)
    mine, theirs = [Chunk(0, 16, 8)], [Chunk(0, 0, 8), Chunk(8, 8, 8)]
    assert len(document_blocks(mine, theirs, layout)) == 2
    # chunk 0-7 is out of every query's reach; of 8-15, keys 13-15 for queries 16-18, banded
    (block,) = document_blocks(mine, theirs, layout, window=4)
    (span,) = block.spans
    assert (span.q, span.k, span.window, span.shift) == (slice(0, 3), slice(5, 8), 4, 3)
    assert block.k == slice(8, 16)


@pytest.mark.parametrize("window", [1, 3, 7, 16])
@pytest.mark.parametrize("packed", [False, True])
def test_core_matches_the_dense_reference(window, packed):
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(B, h, T, DH, generator=g).requires_grad_() for h in (HQ, HKV, HKV))
    ids = packed_doc_ids(B, T, g, p=0.05) if packed else None  # documents of ~20 tokens
    reference = dense_reference_attention(q, k, v, ids, window)
    dout = torch.randn_like(reference)
    expected = (reference, *torch.autograd.grad(reference, (q, k, v), dout))
    docs = DocumentLayout(ids, B, T) if packed else None
    out = AttentionCore(window)(q, k, v, docs)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)
    full = dense_reference_attention(q, k, v, ids)
    assert not torch.allclose(out, full, atol=1e-3)  # the window changed the result
