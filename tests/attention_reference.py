"""The dense-mask attention the kernels are tested against (test reference only, O(T^2) memory).

`dense_reference_attention` builds the [B, 1, T, T] boolean mask (causal and same document),
copies K/V per query head and calls SDPA with the mask: the obvious, slow definition.
`packed_doc_ids` and `positions_from_docs` make packed batches for the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_mask(doc_ids: torch.Tensor | None, batch: int, seq: int, window: int = 0) -> torch.Tensor:
    """[B|1, 1, T, T] boolean: key j visible to query i when j <= i and doc_j == doc_i (and,
    with a sliding `window`, i - j < window)."""
    index = torch.arange(seq)
    allowed = (index[None, :] <= index[:, None]).unsqueeze(0)  # [1, T, T]
    if window:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return allowed.unsqueeze(1)


def dense_reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    window: int = 0,
) -> torch.Tensor:
    """q [B, Hq, T, Dh], k, v [B, Hkv, T, Dh], doc_ids [B, T] or None -> [B, Hq, T, Dh]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = dense_mask(doc_ids, q.shape[0], q.shape[2], window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DenseReferenceCore(torch.nn.Module):
    """A drop-in `attention.core` computing `dense_reference_attention` from the layout's ids."""

    def forward(self, q, k, v, docs):
        return dense_reference_attention(q, k, v, None if docs is None else docs.doc_ids)


def packed_doc_ids(batch: int, seq: int, generator: torch.Generator, p: float = 0.15):
    """Doc ids of packed documents with random boundaries ([B, T], non-decreasing per row)."""
    starts = (torch.rand(batch, seq, generator=generator) < p).long()
    starts[:, 0] = 0
    return starts.cumsum(1)


def positions_from_docs(doc_ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions restarting at every document start."""
    index = torch.arange(doc_ids.shape[1]).expand_as(doc_ids)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(is_start, index, torch.zeros_like(index)).cummax(1).values
    return index - start_index
