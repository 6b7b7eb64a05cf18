"""Grouped-query attention with RoPE and causal / document-masked SDPA.

The projections live in `Attention`; the part that sees all of q, k and v lives in a swappable
`core` module, so context parallelism can replace it with a ring / all-gather version that
reuses `attention_mask` for its own (q positions, k positions) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.rope import apply_rope, rope_cos_sin


@dataclass
class AttentionContext:
    """What the attention core needs besides q, k, v.

    positions: LongTensor [B, T], the RoPE positions of the local tokens (restart per document).
    doc_ids:   LongTensor [B, T] or None; tokens attend only to earlier tokens of the same document.
    """

    positions: torch.Tensor
    doc_ids: torch.Tensor | None = None


def attention_mask(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask, True where query i may attend key j: k_index[j] <= q_index[i] and same doc.

    q_index [Tq] or [B, Tq] and k_index [Tk] or [B, Tk] are the tokens' indices in the full
    (unsharded) sequence; q_doc [B, Tq] and k_doc [B, Tk] their document ids (both or neither).
    Returns [B, 1, Tq, Tk] (B = 1 when nothing is batched), ready for SDPA's `attn_mask`.
    """
    if q_index.dim() == 1:
        q_index = q_index.unsqueeze(0)
    if k_index.dim() == 1:
        k_index = k_index.unsqueeze(0)
    allowed = k_index.unsqueeze(1) <= q_index.unsqueeze(2)  # [B|1, Tq, Tk]
    if (q_doc is None) != (k_doc is None):
        raise ValueError("attention_mask needs both q_doc and k_doc, or neither")
    if q_doc is not None:
        allowed = allowed & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1))
    return allowed.unsqueeze(1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, Dh] -> [B, Hkv * groups, T, Dh], each kv head repeated for its query group."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(Dh) + mask) v with GQA expansion; q [B, Hq, T, Dh], k/v [B, Hkv, T, Dh].

    Without doc_ids the mask is plain causal (`is_causal=True`); with doc_ids a boolean
    [B, 1, T, T] mask allows same-document, causal pairs. Returns [B, Hq, T, Dh].
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if ctx.doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        index = torch.arange(q.shape[2], device=q.device)
        mask = attention_mask(index, index, ctx.doc_ids, ctx.doc_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """x [B, T, D] -> [B, T, D]: project to q/k/v heads, RoPE on q and k, core, output projection.

    The number of heads is inferred from the projected widths at forward time (width / head_dim),
    so tensor parallelism can shard `wq`/`wk`/`wv` column-wise and `wo` row-wise by heads.
    """

    def __init__(
        self, dim: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.core = AttentionCore()

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H * Dh] -> [B, H, T, Dh]."""
        batch, seq = x.shape[:2]
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self._split_heads(self.wq(x))
        k = self._split_heads(self.wk(x))
        v = self._split_heads(self.wv(x))
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, AttentionContext(positions=positions, doc_ids=doc_ids))
        batch, _, seq, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
