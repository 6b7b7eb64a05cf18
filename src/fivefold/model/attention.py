"""Grouped-query attention with RoPE over packed documents, without a T x T mask.

A row of T tokens holds documents back to back (runs of equal `doc_ids`); a token attends to the
earlier tokens of its own document. `DocumentLayout` reads the document boundaries once per
forward (one device-to-host copy of the doc ids when they live on an accelerator) and every
layer reuses them. The attention core picks, per call:

- one document in every row (or no doc ids): SDPA `is_causal=True, enable_gqa=True`, one call;
- CUDA under `torch.compile`, several documents: FlexAttention (`flex_attention`, GQA native,
  no K/V copies) with a document-causal `BlockMask` that `DocumentLayout.flex_block_mask`
  builds once per forward on the host from the document starts (which 128 x 128 tiles are
  empty, full or partial; no T x T mask) before the compiled blocks run, so the block's graph
  holds one flex attention node and no per-document loop, and a new packing neither breaks
  the graph nor recompiles (the mask function is a closure over the doc ids, a graph input);
- CUDA in eager mode, fp16/bf16, several documents: `torch.nn.attention.varlen.varlen_attn`
  over the tokens packed as [B*T, H, Dh] with int32 cumulative document offsets and
  `window_size=(-1, 0)` (causal), GQA native where the installed torch has `enable_gqa`
  (2.13), else K/V heads repeated (2.11; `torch_features.varlen_supports_gqa`); both CUDA
  paths are written against the documented APIs and checked under FakeTensorMode here (no GPU);
- CPU (and CUDA in eager fp32, which the flash kernels lack), several documents: SDPA's CPU
  flash kernel once per document (`is_causal=True`, GQA native; on CUDA the memory-efficient
  kernel) inside the `fivefold::document_attention` custom op
  (with its backward op), which writes every document's output into one [B, T, H, Dh] buffer
  and saves that buffer once (the output projection reads it as a view). A custom op so that
  `torch.compile` keeps it as one node that reads the spans from the doc ids when it runs
  (no graph break, no recompile per packing). Written by hand because SDPA's public entry
  point takes one sequence per call, and FlexAttention has no backward on CPU.

The per-block pieces are the one kernel of this package for attention over spans of a
sequence: context parallelism (`fivefold.parallel.context_parallel`) calls them through
`block_attention`, an autograd function over arbitrary blocks, and through its per-block pieces
(`block_forward`, `block_backward`, `merge_partial`) with query and key chunks that are not the
whole sequence. A block pairs a query chunk with a key chunk; its spans are the per-document
rectangles of that pair (causal on the diagonal, full when the keys precede the queries).
Tensors inside are [B, H, T, Dh] views whose memory is [B, T, H, Dh].
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.weak import WeakTensorKeyDictionary

from fivefold.model.rope import apply_rope
from fivefold.model.torch_features import has, varlen_supports_gqa


# ---- documents -----------------------------------------------------------------------------------
class Chunk(NamedTuple):
    """`length` tokens held at local index `local` that are global tokens [start, start+length)."""

    local: int
    start: int
    length: int


class Span(NamedTuple):
    """Batch rows `rows`: queries `q` attend keys `k` (slices local to a block), causal or full."""

    rows: slice
    q: slice
    k: slice
    causal: bool


class Block(NamedTuple):
    """Local query rows `q` against local key rows `k`; `spans` cover disjoint query rows."""

    q: slice
    k: slice
    spans: tuple[Span, ...]


@dataclass
class DocumentLayout:
    """The documents of a batch, computed once per forward and shared by every layer.

    doc_ids: LongTensor [B, T] (documents are runs of equal ids) or None (one document per row).
    `offsets`: the same documents as host-side cumulative offsets in the flattened [B*T] tokens
    (NumPy int32 [N+1], `fivefold.train.data.Batch.cu_seqlens`), or None.
    `row_groups` are (batch rows, document starts) with consecutive rows of equal boundaries
    merged, read from `offsets` when given (no device read-back), else from `doc_ids` on first
    use (one host copy). `cache` holds what a context-parallel core derives from it for this
    forward (global boundaries, ring blocks).
    """

    doc_ids: torch.Tensor | None
    batch: int
    seq_len: int
    offsets: Any = None
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    _groups: tuple[tuple[slice, tuple[int, ...]], ...] | None = field(default=None, repr=False)
    _single: bool | None = field(default=None, repr=False)

    @property
    def row_groups(self) -> tuple[tuple[slice, tuple[int, ...]], ...]:
        if self._groups is None:
            if self.offsets is not None:
                self._groups = _offset_row_groups(self.offsets, self.batch, self.seq_len)
                if self.doc_ids is not None:  # the `document_attention` op reads it there
                    _doc_ids_cache(self.doc_ids).setdefault("groups", self._groups)
            elif self.doc_ids is None:
                self._groups = _row_groups(None, self.batch, self.seq_len)
            else:
                cache = _doc_ids_cache(self.doc_ids)
                if "groups" not in cache:
                    cache["groups"] = _row_groups(self.doc_ids, self.batch, self.seq_len)
                self._groups = cache["groups"]
        return self._groups

    @property
    def single_document(self) -> bool:
        """Every row is one document (SDPA's plain causal mask is exact); cached, so that once
        read eagerly a compiled block sees a plain bool (`fivefold.parallel.compile`)."""
        if self._single is None:
            self._single = all(len(starts) == 1 for _, starts in self.row_groups)
        return self._single

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(int32 [N+1] cumulative document offsets in the flattened [B*T] tokens, max length)."""
        key = ("cu_seqlens", str(device))
        if key not in self.cache:
            offsets = []
            for rows, starts in self.row_groups:
                for row in range(*rows.indices(self.batch)):
                    offsets += [row * self.seq_len + s for s in starts]
            offsets.append(self.batch * self.seq_len)
            lengths = [b - a for a, b in itertools.pairwise(offsets)]
            cu = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
            self.cache[key] = (cu, max(lengths))
        return self.cache[key]

    def flex_block_mask(self, device: torch.device) -> Any:
        """The document-causal FlexAttention `BlockMask` of this batch on `device` (cached):
        tiles from the host's document starts (`flex_tiles`), the mask function a closure over
        the device's doc ids. Built eagerly, before any compiled block runs."""
        key = ("flex", str(device))
        if key not in self.cache:
            self.cache[key] = _document_block_mask(self, device)
        return self.cache[key]


FLEX_BLOCK = 128  # FlexAttention's default tile on CUDA


def flex_tiles(starts: tuple[int, ...], seq_len: int, block: int = FLEX_BLOCK) -> tuple:
    """(partial [nb, nb], full [nb, nb]) bool tiles of one row of documents starting at `starts`.

    Query tile i meets key tile j (j <= i) when they share a document: the document of j's last
    token is at least that of i's first. A tile is full (no mask needed) when j < i and both
    lie inside one document; the diagonal and every other meeting tile are partial.
    """
    doc = np.zeros(seq_len, dtype=np.int64)
    doc[list(starts[1:])] = 1
    doc = np.cumsum(doc)
    tiles = -(-seq_len // block)
    first = doc[np.arange(tiles) * block]
    last = doc[np.minimum(np.arange(1, tiles + 1) * block, seq_len) - 1]
    i, j = np.arange(tiles)[:, None], np.arange(tiles)[None, :]
    meet = (j <= i) & (last[None, :] >= first[:, None])
    inside = first == last
    full = (j < i) & inside[:, None] & inside[None, :] & (first[:, None] == first[None, :])
    return meet & ~full, full


def _tile_lists(tiles: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, nb, nb] -> (int32 counts [B, 1, nb], int32 ascending indices [B, 1, nb, nb])."""
    counts = tiles.sum(-1, dtype=np.int32)[:, None]
    order = np.argsort(~tiles, axis=-1, kind="stable").astype(np.int32)[:, None]
    return torch.from_numpy(counts), torch.from_numpy(order)


def _document_block_mask(docs: DocumentLayout, device: torch.device) -> Any:
    partial, full = [], []
    for rows, starts in docs.row_groups:
        p, f = flex_tiles(starts, docs.seq_len)
        count = len(range(*rows.indices(docs.batch)))
        partial += [p] * count
        full += [f] * count
    kv_num, kv_idx = _tile_lists(np.stack(partial))
    full_num, full_idx = _tile_lists(np.stack(full))
    ids = docs.doc_ids.to(device, non_blocking=True)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    mask = BlockMask.from_kv_blocks(  # on the host, query-side tiles included
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document_causal,
        seq_lengths=(docs.seq_len, docs.seq_len),
    )
    return mask.to(device)


def _offset_row_groups(offsets: Any, batch: int, seq_len: int):
    """`_row_groups` from host-side cumulative document offsets [N+1] in the [B*T] tokens."""
    flat = [int(o) for o in offsets]
    if flat[-1] != batch * seq_len:
        raise ValueError(f"document offsets end at {flat[-1]}, not at B*T = {batch * seq_len}")
    per_row: list[list[int]] = [[] for _ in range(batch)]
    for offset in flat[:-1]:
        per_row[offset // seq_len].append(offset % seq_len)
    return _merge_rows(per_row)


def _row_groups(
    doc_ids: torch.Tensor | None, batch: int, seq_len: int
) -> tuple[tuple[slice, tuple[int, ...]], ...]:
    """Per run of rows with the same boundaries: (rows, starts of the documents, from 0)."""
    if doc_ids is None:
        return ((slice(0, batch), (0,)),)
    ids = doc_ids.detach().cpu()
    row, col = (ids[:, 1:] != ids[:, :-1]).nonzero(as_tuple=True)
    per_row: list[list[int]] = [[0] for _ in range(batch)]
    for r, c in zip(row.tolist(), col.tolist(), strict=True):
        per_row[r].append(c + 1)
    return _merge_rows(per_row)


def _merge_rows(per_row: list[list[int]]) -> tuple[tuple[slice, tuple[int, ...]], ...]:
    """(rows, document starts) per run of consecutive rows with the same starts."""
    groups: list[tuple[slice, tuple[int, ...]]] = []
    for r, starts in enumerate(per_row):
        if groups and groups[-1][1] == tuple(starts):
            groups[-1] = (slice(groups[-1][0].start, r + 1), groups[-1][1])
        else:
            groups.append((slice(r, r + 1), tuple(starts)))
    return tuple(groups)


def document_blocks(
    q_chunks: list[Chunk], k_chunks: list[Chunk], layout: DocumentLayout
) -> list[Block]:
    """The blocks of queries `q_chunks` against keys `k_chunks`, documents from `layout`.

    Chunks are contiguous ranges of the global sequence that never partly overlap; a key chunk
    after a query chunk is skipped, an equal one gives causal spans, an earlier one full spans.
    """
    blocks = []
    for qc in q_chunks:
        for kc in k_chunks:
            if kc.start >= qc.start + qc.length:
                continue
            diagonal = kc.start == qc.start
            spans = tuple(
                span
                for rows, starts in layout.row_groups
                for span in _chunk_pair_spans(qc, kc, rows, starts, layout.seq_len, diagonal)
            )
            if spans:
                q = slice(qc.local, qc.local + qc.length)
                blocks.append(Block(q, slice(kc.local, kc.local + kc.length), spans))
    return blocks


def _chunk_pair_spans(qc: Chunk, kc: Chunk, rows: slice, starts, seq_len: int, diagonal: bool):
    ends = (*starts[1:], seq_len)
    for d0, d1 in zip(starts, ends, strict=True):
        q0, q1 = max(d0, qc.start), min(d1, qc.start + qc.length)
        k0, k1 = max(d0, kc.start), min(d1, kc.start + kc.length)
        if q0 < q1 and k0 < k1:
            q = slice(q0 - qc.start, q1 - qc.start)
            yield Span(rows, q, slice(k0 - kc.start, k1 - kc.start), diagonal)


# ---- block kernels -------------------------------------------------------------------------------
def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, T, Dh] -> [B, heads, T, Dh] (CUDA efficient kernel only: it has no GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _span_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B,Hq,Tq,Dh], lse fp32 [B,Hq,Tq]) of one span; q [B,Hq,Tq,Dh], k, v [B,Hkv,Tk,Dh]."""
    if q.device.type == "cuda":
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, is_causal=causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, scale=scale
    )
    return out, lse.float()


def _span_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one span given the merged out and lse of its query rows."""
    if q.device.type == "cuda":
        heads = q.shape[1]
        ke, ve = _expand_heads(k, heads), _expand_heads(v, heads)
        tq = q.shape[2]
        lse_padded = lse.new_zeros((*lse.shape[:-1], tq + (-tq) % 32))  # the kernel's layout
        lse_padded[..., :tq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse_padded, seed, seed, 0.0,
            [True, True, True, False], is_causal=causal, scale=scale,
        )  # fmt: skip
        groups = heads // k.shape[1]
        if groups > 1:
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (k.shape[1], groups)).sum(2)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale,
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
    """Whether blocks run as one flash varlen call each (CUDA in fp16/bf16; GQA native, the
    gradients kept in q's dtype) rather than one call per document span."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


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


def _heads_last_buffer(like: torch.Tensor, heads: int, seq: int, dtype) -> torch.Tensor:
    """Zeros [B, heads, seq, Dh] stored as [B, seq, heads, Dh] (so `.transpose(1, 2)` is free)."""
    batch, _, _, dim = like.shape
    return like.new_zeros(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)


def block_forward(q, k, v, block: Block, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (out [B,Hq,|block.q|,Dh] in q's dtype, lse fp32 [B,Hq,|block.q|]).

    Query rows no span covers get out = 0 and lse = -inf, so merging them changes nothing.
    """
    if uses_flash_blocks(q):
        return _flash_block_forward(q, k, v, block, scale)
    qb, kb, vb = q[:, :, block.q], k[:, :, block.k], v[:, :, block.k]
    out = _heads_last_buffer(qb, qb.shape[1], qb.shape[2], q.dtype)
    lse = qb.new_full(qb.shape[:-1], -math.inf, dtype=torch.float32)
    for s in block.spans:
        o, l_ = _span_forward(qb[s.rows, :, s.q], kb[s.rows, :, s.k], vb[s.rows, :, s.k],
                              s.causal, scale)  # fmt: skip
        out[s.rows, :, s.q] = o
        lse[s.rows, :, s.q] = l_
    return out, lse


def block_backward(dout, q, k, v, out, lse, block: Block, scale: float, grads) -> None:
    """Add one block's gradients into `grads` = (dq [B,Hq,Tq,Dh], dk, dv [B,Hkv,Tk,Dh]) (fp32).

    `out` and `lse` are the merged results of the block's query rows (all of `q`'s rows).
    """
    if uses_flash_blocks(q):
        return _flash_block_backward(dout, q, k, v, out, lse, block, scale, grads)
    dq, dk, dv = grads
    for s in block.spans:
        qr, kr = _sub(block.q, s.q), _sub(block.k, s.k)
        bdq, bdk, bdv = _span_backward(
            dout[s.rows, :, qr], q[s.rows, :, qr], k[s.rows, :, kr], v[s.rows, :, kr],
            out[s.rows, :, qr], lse[s.rows, :, qr], s.causal, scale,
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
    out = _heads_last_buffer(q, q.shape[1], q.shape[2], torch.float32)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32)
    for block in blocks:
        block_out, block_lse = block_forward(q, k, v, block, scale)
        out[:, :, block.q], lse[:, :, block.q] = merge_partial(
            out[:, :, block.q], lse[:, :, block.q], block_out, block_lse
        )
    return out.to(q.dtype), lse


def grad_dtype(q: torch.Tensor) -> torch.dtype:
    """What block gradients accumulate in: q's dtype where blocks are flash calls (CUDA), else
    fp32 (the per-span CPU kernels' sums)."""
    return q.dtype if uses_flash_blocks(q) else torch.float32


def zero_grads(q, k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeros in `grad_dtype` for (dq, dk, dv) laid out like q and k ([B, T, H, Dh] memory)."""
    dq = _heads_last_buffer(q, q.shape[1], q.shape[2], grad_dtype(q))
    dk = _heads_last_buffer(k, k.shape[1], k.shape[2], grad_dtype(q))
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


# ---- the single-process core ---------------------------------------------------------------------
def _varlen(q, k, v, docs: DocumentLayout) -> torch.Tensor:
    """CUDA: causal attention per document with `varlen_attn`; q [B,Hq,T,Dh] -> [B,Hq,T,Dh]."""
    from torch.nn.attention.varlen import varlen_attn  # here: it imports torch._dynamo (3 s)

    batch, heads, seq, dim = q.shape
    cu_seqlens, max_len = docs.cu_seqlens(q.device)
    gqa = {}
    if k.shape[1] != heads:
        if varlen_supports_gqa():
            gqa = {"enable_gqa": True}
        else:  # torch 2.11: no GQA in varlen_attn, each K/V head repeated per query group
            k, v = _expand_heads(k, heads), _expand_heads(v, heads)

    def packed(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, Dh] -> [B*T, H, Dh]
        return x.transpose(1, 2).reshape(batch * seq, x.shape[1], dim)

    out = varlen_attn(
        packed(q), packed(k), packed(v), cu_seqlens, cu_seqlens, max_len, max_len,
        window_size=(-1, 0), **gqa,
    )  # fmt: skip
    return out.view(batch, seq, heads, dim).transpose(1, 2)


def flex_document_attention(q, k, v, docs: DocumentLayout) -> torch.Tensor:
    """Causal attention within documents by FlexAttention with the batch's `BlockMask`:
    q [B,Hq,T,Dh], k, v [B,Hkv,T,Dh] -> [B,Hq,T,Dh]; GQA native. Under `torch.compile` (CUDA)
    it becomes one fused kernel with its backward; run eagerly it is torch's reference
    (forward only on CPU), which the tests use to check it."""
    mask = docs.flex_block_mask(q.device)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


_PER_DOC_IDS = WeakTensorKeyDictionary()


def _doc_ids_cache(doc_ids: torch.Tensor) -> dict[str, Any]:
    """What is derived from `doc_ids` on the host, kept while the tensor lives and is unchanged:
    every layer of a forward, its backward and the `document_attention` op share one read."""
    if doc_ids.is_inference():  # no version counter to tell a change
        return {}
    hit = _PER_DOC_IDS.get(doc_ids)
    if hit is None or hit[0] != doc_ids._version:
        hit = (doc_ids._version, {})
        _PER_DOC_IDS[doc_ids] = hit
    return hit[1]


def _whole_sequence_blocks(doc_ids: torch.Tensor) -> list[Block]:
    """The document blocks of the full rows of `doc_ids` [B, T] (cached with the tensor)."""
    cache = _doc_ids_cache(doc_ids)
    if "blocks" not in cache:
        batch, seq = doc_ids.shape
        whole = [Chunk(0, 0, seq)]
        cache["blocks"] = document_blocks(whole, whole, DocumentLayout(doc_ids, batch, seq))
    return cache["blocks"]


@torch.library.custom_op("fivefold::document_attention", mutates_args=())
def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within the documents of `doc_ids` [B, T] (runs of equal ids):
    q [B,Hq,T,Dh], k, v [B,Hkv,T,Dh] -> (out [B,Hq,T,Dh] whose memory is [B,T,Hq,Dh], lse fp32
    [B,Hq,T]). A custom op so that `torch.compile` keeps it as one opaque node: the document
    spans are read from `doc_ids` when it runs, so a new packing never recompiles and the
    block's graph never breaks around attention."""
    return blocks_forward(q, k, v, _whole_sequence_blocks(doc_ids), q.shape[-1] ** -0.5)


@document_attention.register_fake
def _document_attention_fake(q, k, v, doc_ids):
    batch, heads, seq, _ = q.shape
    return _heads_last_buffer(q, heads, seq, q.dtype), q.new_empty(
        batch, heads, seq, dtype=torch.float32
    )


@torch.library.custom_op("fivefold::document_attention_backward", mutates_args=())
def document_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `document_attention`, laid out like q and k ([B, T, H, Dh] memory)."""
    grads = zero_grads(q, k)
    for block in _whole_sequence_blocks(doc_ids):
        block_backward(dout, q, k, v, out, lse, block, q.shape[-1] ** -0.5, grads)
    dq, dk, dv = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@document_attention_backward.register_fake
def _document_attention_backward_fake(dout, q, k, v, out, lse, doc_ids):
    return (
        _heads_last_buffer(q, q.shape[1], q.shape[2], q.dtype),
        _heads_last_buffer(k, k.shape[1], k.shape[2], k.dtype),
        _heads_last_buffer(v, v.shape[1], v.shape[2], v.dtype),
    )


def _document_attention_setup(ctx, inputs, output) -> None:
    q, k, v, doc_ids = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_ids)


def _document_attention_grad(ctx, dout, _dlse):
    q, k, v, out, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = document_attention_backward(dout, q, k, v, out, lse, doc_ids)
    return dq, dk, dv, None


document_attention.register_autograd(
    _document_attention_grad, setup_context=_document_attention_setup
)


def packed_kernel(device: torch.device, dtype: torch.dtype, compiling: bool) -> str:
    """Which kernel runs several documents per row: "flex" (CUDA, compiled), "varlen" (CUDA,
    eager, fp16/bf16) or "document_attention" (the custom op: CPU, and CUDA eager fp32)."""
    if device.type == "cuda":
        if compiling:
            return "flex"
        if dtype in (torch.float16, torch.bfloat16) and has("varlen_attn"):
            return "varlen"
    return "document_attention"


class AttentionCore(nn.Module):
    """Causal attention within documents; q [B,Hq,T,Dh], k, v [B,Hkv,T,Dh] -> [B,Hq,T,Dh].

    `docs` None means one document per row. GQA never copies K/V per query head (but in
    eager CUDA on a torch whose `varlen_attn` lacks GQA). Under `torch.compile` nothing here
    breaks the graph: one-document rows are SDPA in the graph, packed rows FlexAttention on
    CUDA (its `BlockMask` built before the block, `fivefold.parallel.compile`) and the
    `document_attention` op on CPU.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentLayout | None
    ) -> torch.Tensor:
        if docs is None or docs.single_document:
            gqa = k.shape[1] != q.shape[1]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        kernel = packed_kernel(q.device, q.dtype, torch.compiler.is_compiling())
        if kernel == "flex":
            return flex_document_attention(q, k, v, docs)
        if kernel == "varlen":
            return _varlen(q, k, v, docs)
        return document_attention(q, k, v, docs.doc_ids)[0]


class Attention(nn.Module):
    """x [B, T, D] -> [B, T, D]: project to q/k/v heads, RoPE on q and k, core, output projection.

    The number of heads is inferred from the projected widths at forward time (width / head_dim),
    so tensor parallelism can shard `wq`/`wk`/`wv` column-wise and `wo` row-wise by heads.
    `rope` is the (cos, sin) pair of `rope_cos_sin`, computed once per forward by the model.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.core = AttentionCore()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H * Dh] -> [B, T, H, Dh] (a view)."""
        return x.unflatten(-1, (-1, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: DocumentLayout | None = None,
    ) -> torch.Tensor:
        cos, sin = rope
        q = apply_rope(self._heads(self.wq(x)), cos, sin)  # [B, T, Hq, Dh]
        k = apply_rope(self._heads(self.wk(x)), cos, sin)
        v = self._heads(self.wv(x))
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
        return self.wo(out.transpose(1, 2).flatten(2))  # a view when out is [B, T, H, Dh] memory
