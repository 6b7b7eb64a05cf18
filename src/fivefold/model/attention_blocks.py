"""Attention over blocks of a sequence: one query chunk against one key chunk, per-document
spans inside (`fivefold.model.document_layout.Block`). Forward and backward per block (SDPA
per span, or one flash varlen call per block on CUDA), the log-sum-exp merge of partial results
and `block_attention`, the autograd function over a list of blocks that context parallelism and
the single-process kernel share. Tensors are [B, H, T, Dh] views of [B, T, H, Dh] memory.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from fivefold.model.document_layout import Block, Span
from fivefold.model.sliding_window import additive_bias, span_mask


# ---- block kernels -------------------------------------------------------------------------------
def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, T, Dh] -> [B, heads, T, Dh] (CUDA efficient kernel only: it has no GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _span_bias(span: Span, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The additive mask of a windowed span (q [.., Tq, Dh], k [.., Tk, Dh]), None without."""
    if not span.window:
        return None
    mask = span_mask(span.shift, span.window, q.shape[2], k.shape[2], q.device)
    if q.device.type != "cuda":
        return additive_bias(mask, q)
    return additive_bias(mask, q, pad=True).expand(q.shape[0], q.shape[1], -1, -1)


def _span_forward(q, k, v, causal: bool, scale: float, bias=None):
    """(out [B,Hq,Tq,Dh], lse fp32 [B,Hq,Tq]) of one span; q [B,Hq,Tq,Dh], k, v [B,Hkv,Tk,Dh];
    `bias` an additive [1, 1, Tq, Tk] mask (a sliding window; the causal flag is then off)."""
    causal = causal and bias is None
    if q.device.type == "cuda":
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, is_causal=causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=bias, scale=scale
    )
    return out, lse.float()


def _span_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    """(dq, dk, dv) of one span given the merged out and lse of its query rows."""
    causal = causal and bias is None
    if q.device.type == "cuda":
        heads = q.shape[1]
        ke, ve = expand_heads(k, heads), expand_heads(v, heads)
        tq = q.shape[2]
        lse_padded = lse.new_zeros((*lse.shape[:-1], tq + (-tq) % 32))  # the kernel's layout
        lse_padded[..., :tq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, bias, out, lse_padded, seed, seed, 0.0,
            [True, True, True, False], is_causal=causal, scale=scale,
        )  # fmt: skip
        groups = heads // k.shape[1]
        if groups > 1:
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (k.shape[1], groups)).sum(2)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale,
    )  # fmt: skip


# ---- CUDA: one flash varlen call per block ------------------------------------------------------
def varlen_sequences(
    spans: tuple[Span, ...], batch: int, q_len: int, k_len: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block's tokens as flash-attention varlen sequences: (cumulative query offsets,
    cumulative key offsets), both over the flattened [batch * len] tokens of the block.

    Every row's query and key tokens are cut at the documents of its spans, in order; query
    tokens of documents the key chunk lacks form sequences without keys (their output 0, their
    log-sum-exp -inf after `_flash_block_forward`), key tokens of documents the query chunk lacks
    sequences without queries, so both chunks are covered, in place, and never mix documents.
    """
    cu_q, cu_k = [0], [0]

    def add(nq: int, nk: int) -> None:
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nk)

    for row in range(batch):
        qpos = kpos = 0
        for s in sorted((s for s in spans if s.rows.start <= row < s.rows.stop), key=_q_start):
            if s.q.start > qpos:
                add(s.q.start - qpos, 0)
            if s.k.start > kpos:
                add(0, s.k.start - kpos)
            add(s.q.stop - s.q.start, s.k.stop - s.k.start)
            qpos, kpos = s.q.stop, s.k.stop
        if qpos < q_len:
            add(q_len - qpos, 0)
        if kpos < k_len:
            add(0, k_len - kpos)
    return tuple(cu_q), tuple(cu_k)


def _q_start(span: Span) -> int:
    return span.q.start


@functools.lru_cache(maxsize=512)
def _device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 offsets on `device`, copied once per packing (every layer and the backward reuse
    them)."""
    return torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)


def uses_flash_blocks(q: torch.Tensor) -> bool:
    """Whether blocks run as one flash varlen call each (CUDA in fp16/bf16; GQA native, each
    block's gradients returned in q's dtype) rather than one call per document span."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def _flash_block(q: torch.Tensor, block: Block) -> bool:
    """Whether `block` runs as one flash varlen call: `uses_flash_blocks`, and no span banded
    by a sliding window (those run per span, with their mask)."""
    return uses_flash_blocks(q) and not any(s.window for s in block.spans)


def _varlen_args(block: Block, batch: int, q_len: int, k_len: int, device: torch.device):
    cu_q, cu_k = varlen_sequences(block.spans, batch, q_len, k_len)
    longest_q = max(b - a for a, b in itertools.pairwise(cu_q))
    longest_k = max(b - a for a, b in itertools.pairwise(cu_k))
    return _device_offsets(cu_q, device), _device_offsets(cu_k, device), longest_q, longest_k


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] (memory [B, T, H, Dh]) -> [B*T, H, Dh]: a view for one row or whole rows."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x[:, :, rows] of [B, H, T, Dh] (as `narrow`, an op fake CUDA tensors can trace)."""
    return x.narrow(2, rows.start, rows.stop - rows.start)


def _flash_block_forward(q, k, v, block: Block, scale: float):
    """One block in one `_flash_attention_forward` varlen call: (out [B,Hq,Tq,Dh], lse fp32)."""
    qb, kb, vb = _rows(q, block.q), _rows(k, block.k), _rows(v, block.k)
    batch, heads, tq, dim = qb.shape
    cu_q, cu_k, max_q, max_k = _varlen_args(block, batch, tq, kb.shape[2], q.device)
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        _tokens_first(qb), _tokens_first(kb), _tokens_first(vb), cu_q, cu_k, max_q, max_k,
        0.0, block.spans[0].causal, False, scale=scale,
    )  # fmt: skip
    lse = lse.view(heads, batch, tq).transpose(0, 1)  # [B, Hq, Tq]
    lse = torch.where(lse == math.inf, -math.inf, lse)  # queries that meet no key here
    return out.view(batch, tq, heads, dim).transpose(1, 2), lse


def _flash_block_backward(dout, q, k, v, out, lse, block: Block, scale: float, grads) -> None:
    """Add one block's (dq, dk, dv), from one `_flash_attention_backward` call, into `grads`."""
    qr = block.q
    qb, kb, vb = _rows(q, qr), _rows(k, block.k), _rows(v, block.k)
    batch, heads, tq, dim = qb.shape
    tk, kv_heads = kb.shape[2], kb.shape[1]
    cu_q, cu_k, max_q, max_k = _varlen_args(block, batch, tq, tk, q.device)
    lse_b = lse.narrow(2, qr.start, tq).transpose(0, 1).reshape(heads, batch * tq).contiguous()
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's RNG state: none
    bdq, bdk, bdv = torch.ops.aten._flash_attention_backward(
        _tokens_first(_rows(dout, qr)), _tokens_first(qb), _tokens_first(kb), _tokens_first(vb),
        _tokens_first(_rows(out, qr)), lse_b, cu_q, cu_k, max_q, max_k, 0.0,
        block.spans[0].causal, unused, unused, scale=scale,
    )  # fmt: skip
    dq, dk, dv = grads
    _rows(dq, qr).add_(bdq.view(batch, tq, heads, dim).transpose(1, 2))
    _rows(dk, block.k).add_(bdk.view(batch, tk, kv_heads, dim).transpose(1, 2))
    _rows(dv, block.k).add_(bdv.view(batch, tk, kv_heads, dim).transpose(1, 2))


def heads_last_buffer(like: torch.Tensor, heads: int, seq: int, dtype) -> torch.Tensor:
    """Zeros [B, heads, seq, Dh] stored as [B, seq, heads, Dh] (so `.transpose(1, 2)` is free)."""
    batch, _, _, dim = like.shape
    return like.new_zeros(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)


def block_forward(q, k, v, block: Block, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (out [B,Hq,|block.q|,Dh] in q's dtype, lse fp32 [B,Hq,|block.q|]).

    Query rows no span covers get out = 0 and lse = -inf, so merging them changes nothing.
    """
    if _flash_block(q, block):
        return _flash_block_forward(q, k, v, block, scale)
    qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
    out = heads_last_buffer(qb, qb.shape[1], qb.shape[2], q.dtype)
    lse = qb.new_full(qb.shape[:-1], -math.inf, dtype=torch.float32)
    for s in block.spans:
        qs, ks = qb[s.rows, :, s.q], kb[s.rows, :, s.k]
        o, l_ = _span_forward(qs, ks, vb[s.rows, :, s.k], s.causal, scale, _span_bias(s, qs, ks))
        out[s.rows, :, s.q] = o
        lse[s.rows, :, s.q] = l_
    return out, lse


def block_backward(dout, q, k, v, out, lse, block: Block, scale: float, grads) -> None:
    """Add one block's gradients into `grads` = (dq [B,Hq,Tq,Dh], dk, dv [B,Hkv,Tk,Dh]) (fp32).

    `out` and `lse` are the merged results of the block's query rows (all of `q`'s rows).
    """
    if _flash_block(q, block):
        return _flash_block_backward(dout, q, k, v, out, lse, block, scale, grads)
    dq, dk, dv = grads
    for s in block.spans:
        qr, kr = _sub(block.q, s.q), _sub(block.k, s.k)
        qs, ks = q[s.rows, :, qr], k[s.rows, :, kr]
        bdq, bdk, bdv = _span_backward(
            dout[s.rows, :, qr], qs, ks, v[s.rows, :, kr],
            out[s.rows, :, qr], lse[s.rows, :, qr], s.causal, scale, _span_bias(s, qs, ks),
        )  # fmt: skip
        dq[s.rows, :, qr] += bdq
        dk[s.rows, :, kr] += bdk
        dv[s.rows, :, kr] += bdv


def _sub(outer: slice, inner: slice) -> slice:
    """`inner` (relative to `outer`'s start) as an absolute slice."""
    return slice(outer.start + inner.start, outer.start + inner.stop)


def merge_partial(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's (out, lse) into the running fp32 (out, lse); either may be -inf rows."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    out = (
        out * torch.exp(lse - safe)[..., None]
        + block_out.float() * torch.exp(block_lse - safe)[..., None]
    )
    return out, new_lse


def blocks_forward(q, k, v, blocks: list[Block], scale: float):
    """All blocks on local tensors: (out [B,Hq,Tq,Dh] in q's dtype, lse fp32 [B,Hq,Tq])."""
    if len(blocks) == 1 and blocks[0].q == slice(0, q.shape[2]):
        return block_forward(q, k, v, blocks[0], scale)
    out = heads_last_buffer(q, q.shape[1], q.shape[2], torch.float32)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32)
    for block in blocks:
        block_out, block_lse = block_forward(q, k, v, block, scale)
        out[:, :, block.q], lse[:, :, block.q] = merge_partial(
            out[:, :, block.q], lse[:, :, block.q], block_out, block_lse
        )
    return out.to(q.dtype), lse


def zero_grads(q, k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 zeros for (dq, dk, dv) laid out like q and k ([B, T, H, Dh] memory): block
    gradients (bf16 from CUDA's flash kernel) are summed in fp32, as torch's ring attention
    sums them, and cast to the inputs' dtype once at the end."""
    dq = heads_last_buffer(q, q.shape[1], q.shape[2], torch.float32)
    dk = heads_last_buffer(k, k.shape[1], k.shape[2], torch.float32)
    return dq, dk, torch.zeros_like(dk)


class _BlockAttention(torch.autograd.Function):
    """Attention over document blocks of local q, k, v; saves q, k, v, out and lse only."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale):
        out, lse = blocks_forward(q, k, v, blocks, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = zero_grads(q, k)
        for block in ctx.blocks:
            block_backward(dout, q, k, v, out, lse, block, ctx.scale, grads)
        dq, dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_attention(q, k, v, blocks: list[Block], scale: float | None = None) -> torch.Tensor:
    """Attention of q [B,Hq,Tq,Dh] on k, v [B,Hkv,Tk,Dh] restricted to `blocks` (document_blocks).

    Returns [B, Hq, Tq, Dh] whose memory is [B, Tq, Hq, Dh]; Hkv must divide Hq.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockAttention.apply(q, k, v, blocks, scale)
