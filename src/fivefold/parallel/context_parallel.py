"""Context parallelism: the sequence split over the CP group, attention computed across it.

Details: docs/internals.md (`fivefold.parallel.context_parallel`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from fivefold.model.attention_blocks import (
    block_attention,
    block_backward,
    block_forward,
    merge_partial,
)
from fivefold.model.document_layout import Block, Chunk, DocumentLayout, document_blocks
from fivefold.model.torch_features import has


# ---- layout --------------------------------------------------------------------------------------
def load_balanced_indices(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global token indices held by `cp_rank`: chunk r then chunk 2*cp-1-r. LongTensor [T/cp]."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp_size} for "
            "load-balanced context parallelism"
        )
    c = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    tail_chunk = 2 * cp_size - 1 - cp_rank
    tail = torch.arange(tail_chunk * c, (tail_chunk + 1) * c)
    return torch.cat([head, tail])


def shard_sequence_for_cp(
    x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1
) -> torch.Tensor:
    """This rank's load-balanced share of `x` along `dim` (the sequence dimension)."""
    index = load_balanced_indices(x.shape[dim], cp_rank, cp_size).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence_for_cp(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence_for_cp`: the full sequence from all ranks' shares (rank order)."""
    cp_size = len(shards)
    seq_len = shards[0].shape[dim] * cp_size
    order = torch.cat([load_balanced_indices(seq_len, r, cp_size) for r in range(cp_size)])
    stacked = torch.cat(shards, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(stacked.device))


def shard_batch_for_cp(batch: Any, cp_rank: int, cp_size: int) -> Any:
    """A copy of `batch` (tokens, labels, positions, doc_ids: [B, T]) with this rank's tokens.

    Positions and doc ids travel with their tokens, so RoPE and document masks stay exact.
    """
    if cp_size == 1:
        return batch
    fields = ("tokens", "labels", "positions", "doc_ids")
    changes = {
        f: shard_sequence_for_cp(getattr(batch, f), cp_rank, cp_size)
        for f in fields
        if getattr(batch, f, None) is not None
    }
    # `cu_seqlens` stays: the whole rows' host offsets, from which the CP core reads the global
    # documents (`DocumentLayout.whole_offsets`) without gathering and reading back doc ids.
    return dataclasses.replace(batch, **changes)


# ---- documents and blocks, once per forward ------------------------------------------------------
def local_chunks(rank: int, size: int, chunk: int) -> list[Chunk]:
    """The two chunks CP rank `rank` holds (head then tail), `chunk` tokens each."""
    return [Chunk(0, rank * chunk, chunk), Chunk(chunk, (2 * size - 1 - rank) * chunk, chunk)]


def rank_order_chunks(size: int, chunk: int) -> list[Chunk]:
    """Every rank's chunks as laid out when the ranks' shares are concatenated in rank order."""
    return [
        Chunk(rank * 2 * chunk + c.local, c.start, c.length)
        for rank in range(size)
        for c in local_chunks(rank, size, chunk)
    ]


def _global_documents(
    docs: DocumentLayout | None, group: dist.ProcessGroup, batch: int, local_len: int
) -> DocumentLayout:
    """The documents of the whole sequence: from the whole rows' host offsets when the batch
    brought them, else the local doc ids all-gathered (once per forward) and read back."""
    size = dist.get_world_size(group)
    if docs is not None and docs.whole_offsets is not None:  # the host has them: no gather
        return DocumentLayout(None, batch, local_len * size, docs.whole_offsets)
    if docs is None or docs.doc_ids is None:
        return DocumentLayout(None, batch, local_len * size)
    key = ("cp-documents", id(group))
    if key not in docs.cache:
        parts = [torch.empty_like(docs.doc_ids) for _ in range(size)]
        dist.all_gather(parts, docs.doc_ids.contiguous(), group=group)
        full = unshard_sequence_for_cp(parts, dim=1)
        docs.cache[key] = DocumentLayout(full, batch, local_len * size)
    return docs.cache[key]


def _cached_blocks(docs: DocumentLayout | None, key: tuple, build) -> Any:
    if docs is None:
        return build()
    if key not in docs.cache:
        docs.cache[key] = build()
    return docs.cache[key]


def _cp_blocks(
    kind: str, q, docs: DocumentLayout | None, group: dist.ProcessGroup, window: int = 0
):
    """The blocks of `kind` for this rank ([per ring step] for the ring), built once per forward,
    within a sliding `window` of keys when > 0: a ring step whose chunks lie wholly outside the
    window has no block (its K/V still pass on, nothing is computed)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local_len = q.shape[2] if kind != "ulysses" else q.shape[2] // size
    chunk = local_len // 2

    def build():
        layout = _global_documents(docs, group, q.shape[0], local_len)
        mine = local_chunks(rank, size, chunk)
        if kind == "ring":
            return [
                document_blocks(
                    mine, local_chunks((rank - step) % size, size, chunk), layout, window
                )
                for step in range(size)
            ]
        everyone = rank_order_chunks(size, chunk)
        queries = mine if kind == "allgather" else everyone
        return document_blocks(queries, everyone, layout, window)

    return _cached_blocks(docs, (kind, id(group), window), build)


# ---- ring ----------------------------------------------------------------------------------------
def _ring_exchange(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int = 0
) -> tuple[list[torch.Tensor], Any]:
    """Send `tensors` (packed) to the next CP rank and receive the previous rank's; async.

    Returns (receive buffers shaped like `tensors`, wait function).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buf = torch.empty_like(flat)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, flat, group=group, group_peer=(rank + 1) % size, tag=tag),
            dist.P2POp(dist.irecv, buf, group=group, group_peer=(rank - 1) % size, tag=tag),
        ]
    )
    out, offset = [], 0
    for t in tensors:
        out.append(buf[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()

    keep = (flat, works)  # the send buffer lives until the exchange is done

    def wait() -> None:
        for w in keep[1]:
            w.wait()

    return out, wait


class _RingAttention(torch.autograd.Function):
    """Ring attention over the CP group.

    Forward: K/V pass around the ring (rank r -> r+1) cp-1 times; each rank attends its local
    queries to each block it holds and merges the partial results by log-sum-exp.
    Backward: the same ring again; dQ accumulates locally, dK/dV travel with their block (one
    exchange in flight while the next block computes) and make one last hop home.
    """

    @staticmethod
    def forward(ctx, q, k, v, steps, group, scale):
        size = dist.get_world_size(group)
        out = torch.zeros_like(q, dtype=torch.float32)  # keeps q's [B, T, H, Dh] memory
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(size):
            wait = None
            if step < size - 1:
                next_kv, wait = _ring_exchange(kv, group)
            for block in steps[step]:
                block_out, block_lse = block_forward(q, kv[0], kv[1], block, scale)
                out[:, :, block.q], lse[:, :, block.q] = merge_partial(
                    out[:, :, block.q], lse[:, :, block.q], block_out, block_lse
                )
            if wait is not None:
                wait()
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.steps, ctx.group, ctx.scale = steps, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        steps, group, scale = ctx.steps, ctx.group, ctx.scale
        size = dist.get_world_size(group)
        dq = torch.zeros_like(q, dtype=torch.float32)  # sums of bf16 flash blocks kept in fp32
        kv, incoming = [k, v], None
        for step in range(size):
            wait_kv = None
            if step < size - 1:
                next_kv, wait_kv = _ring_exchange(kv, group)
            dk, dv = (torch.zeros_like(k, dtype=torch.float32) for _ in range(2))  # fp32 hops
            for block in steps[step]:
                block_backward(dout, q, kv[0], kv[1], out, lse, block, scale, (dq, dk, dv))
            if incoming is not None:  # the block's dK/dV from the ranks that held it before
                (prev_dk, prev_dv), wait_in = incoming
                wait_in()
                dk += prev_dk
                dv += prev_dv
            incoming = _ring_exchange([dk, dv], group, tag=1)  # on to the next holder
            if wait_kv is not None:
                wait_kv()
                kv = next_kv
        (dk, dv), wait_in = incoming  # the last hop brought this rank's own block home
        wait_in()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentLayout | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention within documents of this rank's load-balanced share of a sequence.

    q [B, Hq, T/cp, Dh], k and v [B, Hkv, T/cp, Dh] (after RoPE; Hkv divides Hq), in the layout
    of `load_balanced_indices`; `docs` the model's layout of the local doc ids (None: one
    document per row); `window` > 0 a sliding window of that many keys. Returns
    [B, Hq, T/cp, Dh].
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    steps = _cp_blocks("ring", q, docs, group, window)
    return _RingAttention.apply(q, k, v, steps, group, scale)


# ---- all-gather and all-to-all variants ----------------------------------------------------------
def _all_gather_autograd(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` all-gathered along `dim` over `group` (backward: reduce-scatter). torch 2.13 names it
    `all_gather_single_autograd`; 2.11 and 2.12 have only `all_gather_tensor_autograd`."""
    if has("all_gather_single_autograd"):
        return funcol.all_gather_single_autograd(x, gather_dim=dim, group=group)
    return funcol.all_gather_tensor_autograd(x, gather_dim=dim, group=group)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentLayout | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Same contract as `ring_attention`; K/V all-gathered (backward: reduce-scatter)."""
    k_all = _all_gather_autograd(k.contiguous(), 2, group)
    v_all = _all_gather_autograd(v.contiguous(), 2, group)
    blocks: list[Block] = _cp_blocks("allgather", q, docs, group, window)
    return block_attention(q, k_all, v_all, blocks, scale)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, T/cp, D] sequence-sharded -> [B, H/cp, T, D] head-sharded (rank-order tokens)."""
    size = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return (
        recv.reshape(size, b, h // size, t, d).permute(1, 2, 0, 3, 4).reshape(b, h // size, -1, d)
    )


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, H/cp, T, D] -> [B, H, T/cp, D]."""
    size = dist.get_world_size(group)
    b, h_local, seq, d = x.shape
    send = x.reshape(b, h_local, size, seq // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return (
        recv.reshape(size, b, h_local, seq // size, d)
        .transpose(0, 1)
        .reshape(b, -1, seq // size, d)
    )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentLayout | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Same contract as `ring_attention`; all-to-all to head shards (needs cp | Hq).

    K/V heads are sent unexpanded when cp divides Hkv, else expanded to Hq heads first (the
    head shards must pair each query head with its K/V head).
    """
    size = dist.get_world_size(group)
    if q.shape[1] % size:
        raise ValueError(
            f"ulysses context parallelism needs cp = {size} to divide heads {q.shape[1]}"
        )
    if k.shape[1] % size:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q_h, k_h, v_h = (_seq_to_heads(x, group) for x in (q, k, v))
    blocks: list[Block] = _cp_blocks("ulysses", q_h, docs, group, window)
    return _heads_to_seq(block_attention(q_h, k_h, v_h, blocks, scale), group)


# ---- model integration ---------------------------------------------------------------------------
CP_FUNCTIONS = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "ulysses": ulysses_attention,
}


class ContextParallelAttentionCore(nn.Module):
    """Drop-in `attention.core` that attends across the CP group with the chosen kind.

    forward(q [B,Hq,T/cp,Dh], k, v [B,Hkv,T/cp,Dh], docs: DocumentLayout | None) ->
    [B,Hq,T/cp,Dh]; `docs` is the model's layout of the local doc ids, where this core caches
    the global documents and its blocks for the rest of the forward. `window` > 0: the layer's
    sliding window of keys (`fivefold.model.sliding_window`).
    """

    def __init__(self, group: dist.ProcessGroup, kind: str = "ring", window: int = 0):
        super().__init__()
        if kind not in CP_FUNCTIONS:
            raise ValueError(f"cp kind must be one of {tuple(CP_FUNCTIONS)}, got {kind!r}")
        self.group, self.kind, self.window = group, kind, window

    def forward(self, q, k, v, docs: DocumentLayout | None = None):
        return CP_FUNCTIONS[self.kind](q, k, v, docs, self.group, window=self.window)

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window else ""
        return f"kind={self.kind}, cp={dist.get_world_size(self.group)}{window}"


def apply_context_parallel(model: nn.Module, cp_mesh: Any, kind: str = "ring") -> nn.Module:
    """Swap every block's `attention.core` for a context-parallel one over `cp_mesh` (1-D mesh or
    ProcessGroup). Works on whole models and on pipeline chunks. Returns the model."""
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    for block in model.layers.values():
        window = block.attention.window
        block.attention.core = ContextParallelAttentionCore(group, kind, window)
    return model
