"""Sliding-window attention (Mistral, windowed Qwen, alternating layers): a query at position i
of a document sees the keys j of its document with i - w < j <= i, w keys at most itself
included (`transformers`' `sliding_window_overlay`). Which layers slide is
`ModelSpec.layer_window`; each attention path applies the window its own way:

- a span of a block (`fivefold.model.document_layout.Span`, CPU kernel, CUDA per-span
  kernel): trimmed to the keys and queries the window joins (`window_span`), then, where the
  band still cuts the rectangle, a mask (`span_mask`);
- one document per row: SDPA with the band as its mask (`windowed_sdpa`);
- FlexAttention: the band in its mask function and its tiles (`fivefold.model.document_layout`);
- CUDA `varlen_attn`: its own window, (w - 1) keys back (`varlen_window`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def effective_window(window: int, seq_len: int) -> int:
    """The window a layer applies to rows of `seq_len` tokens: 0 (none) when it spans them."""
    return window if window < seq_len else 0


def varlen_window(window: int) -> tuple[int, int]:
    """flash attention's (keys back, keys ahead) for a causal window of `window` keys."""
    return (window - 1, 0) if window else (-1, 0)


def window_span(
    q0: int, q1: int, k0: int, k1: int, window: int
) -> tuple[int, int, int, int, bool] | None:
    """Global query rows [q0, q1) and key rows [k0, k1) of one document, keys no later than
    queries (k1 <= q0, or the same rows: the diagonal), trimmed to what a window of `window`
    keys joins: (q0, q1', k0', k1, needs a mask), None when no query meets any key.

    Every query kept meets at least one key; the mask is needed where some kept pair lies
    outside the window (on the diagonal also: where the causal triangle alone is wider).
    """
    k0 = max(k0, q0 - window + 1)
    q1 = min(q1, k1 + window - 1) if k1 <= q0 else q1
    if q0 >= q1 or k0 >= k1:
        return None
    return q0, q1, k0, k1, q1 - 1 - k0 >= window


def span_mask(shift: int, window: int, q_len: int, k_len: int, device) -> torch.Tensor:
    """bool [q_len, k_len]: query i sees key j when 0 <= shift + i - j < window, `shift` the
    global position of the first query less that of the first key."""
    distance = (
        shift
        + torch.arange(q_len, device=device)[:, None]
        - torch.arange(k_len, device=device)[None, :]
    )
    return (distance >= 0) & (distance < window)


def windowed_sdpa(q, k, v, window: int) -> torch.Tensor:
    """Causal attention of one document per row within `window` keys: q [B,Hq,T,Dh], k, v
    [B,Hkv,T,Dh] -> [B,Hq,T,Dh] (SDPA with the band as a [T, T] mask)."""
    seq = q.shape[2]
    mask = span_mask(0, window, seq, seq, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
    )


def additive_bias(mask: torch.Tensor, like: torch.Tensor, pad: bool = False) -> torch.Tensor:
    """A bool mask [Tq, Tk] as the additive bias the SDPA kernels take: 0 or -inf in `like`'s
    dtype, [1, 1, Tq, Tk]; with `pad` over storage whose last dimension is padded to a
    multiple of 16 (CUDA's memory-efficient kernel's alignment, as SDPA pads it)."""
    q_len, k_len = mask.shape
    padded = like.new_zeros(1, 1, q_len, k_len + ((-k_len) % 16 if pad else 0))
    bias = padded[..., :k_len]
    bias.masked_fill_(~mask, float("-inf"))
    return bias
