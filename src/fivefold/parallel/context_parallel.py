"""Context parallelism: the sequence split over the CP group, attention computed across it.

Written by hand because torch's `context_parallel` does not run on CPU (see the gloo notes).

Layout (load-balanced for causal masks). A sequence of T tokens is cut into 2*cp chunks of
c = T / (2*cp) tokens; CP rank r holds chunk r (its "head") followed by chunk 2*cp-1-r (its
"tail"). Every rank then owns the same amount of causal attention work. Tokens, labels,
positions and doc_ids are all sharded with this one layout (`shard_batch_for_cp`), so RoPE uses
the true positions and document masks compare true document ids.

Three ways to attend across the group, chosen by `plan.cp_kind`:
- "ring": K/V blocks travel around the ring (rank r sends to r+1) while each rank attends its
  queries to the block it holds; the partial results are merged by log-sum-exp. The backward
  runs the same ring again, with the K/V gradients travelling beside their blocks and arriving
  home after the last hop. Load balancing also removes work: a block from an earlier rank is
  seen whole by all local queries but only through its head chunk, and a block from a later rank
  is seen only by the local tail chunk. An autograd Function with an explicit backward.
- "allgather": every rank all-gathers K/V (autograd all-gather, whose backward is a
  reduce-scatter) and attends its local queries to the whole sequence.
- "ulysses": an all-to-all turns sequence shards into head shards, full-sequence attention runs
  on H/cp heads, and a second all-to-all turns the output back.

Masks are built from each token's global index in the sequence (from the layout, never from the
RoPE positions, which restart at document boundaries) and from the doc ids: key j is visible to
query i when index_j <= index_i and doc_j == doc_i.

Block kernels: "math" is plain fp32 matmul + logsumexp (the reference); "fused" calls the
kernel that returns the LSE (CPU: `_scaled_dot_product_flash_attention_for_cpu`, about ten
times faster than math; CUDA: `_scaled_dot_product_efficient_attention`, which takes a mask);
"auto" picks fused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from fivefold.model.attention import attention_mask, repeat_kv

KERNELS = ("auto", "math", "fused")


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
    return dataclasses.replace(batch, **changes)


# ---- masks and block kernels ---------------------------------------------------------------------
# A block is described by (mask, causal): `mask` a boolean visibility mask [B|1, 1, Tq, Tk] or
# None; `causal` (only used when mask is None) means plain lower-triangular visibility, which is
# exactly the diagonal block without documents: a rank's tokens are in increasing global order.
def _block_mask(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    q_docs: torch.Tensor | None,
    k_docs: torch.Tensor | None,
    causal: bool,
) -> tuple[torch.Tensor | None, bool]:
    """(mask, causal) of a block; `causal=False` for blocks wholly before the queries."""
    if q_docs is None:
        return None, causal
    if causal:
        return attention_mask(q_index, k_index, q_docs, k_docs), False
    return (q_docs[:, :, None] == k_docs[:, None, :])[:, None], False


def _reduce_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum an expanded K/V gradient back onto its Hkv heads: [B, H, T, D] -> [B, Hkv, T, D]."""
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(2)


def _bool_mask(
    mask: torch.Tensor | None, causal: bool, tq: int, tk: int, device
) -> torch.Tensor | None:
    if mask is None and causal:
        return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()[None, None]
    return mask


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype, align: int = 1):
    """0 / -inf float mask; with `align`, stored with its last dim padded to a multiple of it
    (the CUDA memory-efficient kernel needs 16-aligned bias rows)."""
    if mask is None:
        return None
    tk = mask.shape[-1]
    padded = torch.zeros((*mask.shape[:-1], tk + (-tk) % align), dtype=dtype, device=mask.device)
    padded[..., :tk].masked_fill_(~mask, -math.inf)
    return padded[..., :tk]


def _pick_kernel(kernel: str, device: torch.device) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "fused" if device.type in ("cpu", "cuda") else "math"
    return kernel


def _block_forward(q, k, v, mask, causal, scale, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B,H,Tq,D] on k, v [B,H,Tk,D] -> (out [B,H,Tq,D], lse fp32 [B,H,Tq]).

    Rows that see no key get out = 0 and lse = -inf, so merging them changes nothing.
    """
    if kernel == "math":
        mask = _bool_mask(mask, causal, q.shape[2], k.shape[2], q.device)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        lse = scores.logsumexp(-1)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        out = torch.exp(scores - safe_lse[..., None]) @ v.float()
        return out.to(q.dtype), lse
    if q.device.type == "cuda":
        bias = _additive_mask(mask, q.dtype, align=16)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, is_causal=causal, scale=scale
        )
        lse = lse[..., : q.shape[2]].float()
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale
        )
        lse = lse.float()
    if mask is not None:
        sees_nothing = ~mask.any(-1).expand_as(lse)
        lse = lse.masked_fill(sees_nothing, -math.inf)
        out = out.masked_fill(sees_nothing[..., None], 0.0)
    return out, lse


def _block_backward(dout, q, k, v, out, lse, mask, causal, scale, kernel):
    """Gradients of one block given the *merged* out and lse of its query rows (all finite).

    With P = exp(q k^T * scale - lse) the block's share of the softmax:
    dv = P^T dout, dP = dout v^T, dS = P * (dP - rowsum(dout * out)), dq = dS k * scale,
    dk = dS^T q * scale. Returns fp32 (dq [B,H,Tq,D], dk, dv [B,H,Tk,D]).
    """
    if kernel == "math":
        mask = _bool_mask(mask, causal, q.shape[2], k.shape[2], q.device)
        qf, kf, vf, gf = q.float(), k.float(), v.float(), dout.float()
        scores = (qf @ kf.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        p = torch.exp(scores - lse[..., None])
        delta = (gf * out.float()).sum(-1, keepdim=True)
        dv = p.transpose(-1, -2) @ gf
        ds = p * (gf @ vf.transpose(-1, -2) - delta)
        return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, dv
    if q.device.type == "cuda":
        bias = _additive_mask(mask, q.dtype, align=16)
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        tq = q.shape[2]
        lse_padded = lse.new_zeros((*lse.shape[:-1], tq + (-tq) % 32))  # kernel's LSE layout
        lse_padded[..., :tq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_padded, seed, seed, 0.0,
            [True, True, True, False], is_causal=causal, scale=scale,
        )  # fmt: skip
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal,
            attn_mask=_additive_mask(mask, q.dtype), scale=scale,
        )  # fmt: skip
    return dq.float(), dk.float(), dv.float()


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold a block's (out, lse) into the running (out, lse); running lse must be finite.

    out' = (out e^lse + b e^blse) / (e^lse + e^blse), written with sigmoids for stability.
    """
    weight = torch.sigmoid(block_lse - lse)[..., None]
    out = out - weight * (out - block_out.float())
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


# ---- ring ----------------------------------------------------------------------------------------
def _ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list, Any]:
    """Send `tensors` (packed) to the next CP rank and receive the previous rank's; async.

    Returns (receive buffers, wait function).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    buf = torch.empty_like(flat)
    ops = [
        dist.P2POp(dist.isend, flat, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, buf, group=group, group_peer=(rank - 1) % size),
    ]
    works = dist.batch_isend_irecv(ops)
    out, offset = [], 0
    for t in tensors:
        out.append(buf[offset : offset + t.numel()].view_as(t))
        offset += t.numel()

    def wait() -> None:
        for w in works:
            w.wait()

    return out, wait


def _ring_block_plan(step: int, rank: int, size: int, chunk: int):
    """Which query rows and key columns of the block held at `step` can interact, and if causal.

    Returns (source rank, query slice, key slice, needs causal mask).
    """
    source = (rank - step) % size
    if step == 0:
        return source, slice(None), slice(None), True
    if source < rank:  # earlier rank: only its head chunk precedes our tokens, and it all does
        return source, slice(None), slice(0, chunk), False
    return source, slice(chunk, None), slice(None), False  # later rank: only our tail sees it


def _ring_block(
    step: int,
    rank: int,
    size: int,
    chunk: int,
    q_index: torch.Tensor,
    doc_ids: torch.Tensor | None,
    all_docs: torch.Tensor | None,
) -> tuple[slice, slice, torch.Tensor | None, bool]:
    """(query slice, key slice, mask, causal) of the K/V block this rank holds at ring `step`.

    q_index [2*chunk] holds the global positions of this rank's tokens; doc_ids [B, 2*chunk] and
    all_docs [cp, B, 2*chunk] are its and every rank's document ids (both None without them).
    """
    source, qs, ks, causal = _ring_block_plan(step, rank, size, chunk)
    k_index = load_balanced_indices(2 * chunk * size, source, size).to(q_index.device)
    mask, causal = _block_mask(
        q_index[qs], k_index[ks],
        None if doc_ids is None else doc_ids[:, qs],
        None if doc_ids is None else all_docs[source][:, ks],
        causal,
    )  # fmt: skip
    return qs, ks, mask, causal


class _RingAttention(torch.autograd.Function):
    """Ring attention over the CP group.

    Forward: K/V pass around the ring (rank r -> r+1) cp-1 times; each rank attends its local
    queries to each block it holds and merges the partial results by log-sum-exp.
    Backward: the same ring again; dQ accumulates locally, dK/dV travel with their block and
    make one last hop home.
    """

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, group, scale, kernel):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        chunk = q.shape[2] // 2
        index = load_balanced_indices(2 * chunk * size, rank, size).to(q.device)
        all_docs = _gather_doc_ids(doc_ids, group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(size):
            wait = None
            if step < size - 1:
                next_kv, wait = _ring_exchange(kv, group)
            qs, ks, mask, causal = _ring_block(step, rank, size, chunk, index, doc_ids, all_docs)
            block_out, block_lse = _block_forward(
                q[:, :, qs],
                repeat_kv(kv[0][:, :, ks], groups),
                repeat_kv(kv[1][:, :, ks], groups),
                mask, causal, scale, kernel,
            )  # fmt: skip
            if step == 0:
                out, lse = block_out.float(), block_lse
            else:
                out[:, :, qs], lse[:, :, qs] = _merge(
                    out[:, :, qs], lse[:, :, qs], block_out, block_lse
                )
            if wait is not None:
                wait()
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, doc_ids, all_docs)
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_ids, all_docs = ctx.saved_tensors
        group, scale, kernel = ctx.group, ctx.scale, ctx.kernel
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        chunk = q.shape[2] // 2
        index = load_balanced_indices(2 * chunk * size, rank, size).to(q.device)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for step in range(size):
            wait_kv = None
            if step < size - 1:
                next_kv, wait_kv = _ring_exchange(kv, group)
            qs, ks, mask, causal = _ring_block(step, rank, size, chunk, index, doc_ids, all_docs)
            bdq, bdk, bdv = _block_backward(
                dout[:, :, qs], q[:, :, qs],
                repeat_kv(kv[0][:, :, ks], groups), repeat_kv(kv[1][:, :, ks], groups),
                out[:, :, qs], lse[:, :, qs], mask, causal, scale, kernel,
            )  # fmt: skip
            dq[:, :, qs] += bdq
            dkv[0][:, :, ks] += _reduce_kv_grad(bdk, groups)
            dkv[1][:, :, ks] += _reduce_kv_grad(bdv, groups)
            if size > 1:  # dK/dV follow their block; after the last step they reach home
                dkv, wait_dkv = _ring_exchange(dkv, group)
                wait_dkv()
            if wait_kv is not None:
                wait_kv()
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _gather_doc_ids(doc_ids: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Every CP rank's local doc ids, [cp, B, T/cp] (None stays None)."""
    if doc_ids is None:
        return None
    parts = [torch.empty_like(doc_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, doc_ids.contiguous(), group=group)
    return torch.stack(parts)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal (and document-masked) attention of this rank's load-balanced share of a sequence.

    q [B, Hq, T/cp, Dh], k and v [B, Hkv, T/cp, Dh] (after RoPE; Hkv divides Hq), doc_ids
    [B, T/cp] or None, all in the layout of `load_balanced_indices`. Returns [B, Hq, T/cp, Dh].
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(
        q, k.contiguous(), v.contiguous(), doc_ids, group, scale, _pick_kernel(kernel, q.device)
    )


# ---- all-gather and all-to-all variants ----------------------------------------------------------
def _full_layout_index(local_len: int, size: int, device: torch.device) -> torch.Tensor:
    """Global indices of the tokens of all CP ranks concatenated in rank order, [T]."""
    seq_len = local_len * size
    return torch.cat([load_balanced_indices(seq_len, r, size) for r in range(size)]).to(device)


def _full_layout_doc_ids(
    doc_ids: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor | None:
    """All CP ranks' doc ids in the `_full_layout_index` token order, [B, T] (None stays None)."""
    all_docs = _gather_doc_ids(doc_ids, group)
    if all_docs is None:
        return None
    return all_docs.permute(1, 0, 2).reshape(all_docs.shape[1], -1)


def _sdpa(q, k, v, mask, scale):
    """Plain SDPA with a boolean visibility mask (every query sees at least itself)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `ring_attention`; K/V all-gathered (backward: reduce-scatter)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    groups = q.shape[1] // k.shape[1]
    k_all = funcol.all_gather_single_autograd(k.contiguous(), gather_dim=2, group=group)
    v_all = funcol.all_gather_single_autograd(v.contiguous(), gather_dim=2, group=group)
    q_index = load_balanced_indices(q.shape[2] * size, rank, size).to(q.device)
    k_index = _full_layout_index(q.shape[2], size, q.device)
    mask = attention_mask(q_index, k_index, doc_ids, _full_layout_doc_ids(doc_ids, group))
    return _sdpa(q, repeat_kv(k_all, groups), repeat_kv(v_all, groups), mask, scale)


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
    doc_ids: torch.Tensor | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `ring_attention`; all-to-all to head shards (needs cp | Hq).

    K/V heads are sent unexpanded when cp divides Hkv, else expanded to Hq heads first.
    """
    size = dist.get_world_size(group)
    if q.shape[1] % size:
        raise ValueError(
            f"ulysses context parallelism needs cp = {size} to divide heads {q.shape[1]}"
        )
    groups = q.shape[1] // k.shape[1]
    if k.shape[1] % size:
        k, v, groups = repeat_kv(k, groups), repeat_kv(v, groups), 1
    q_h, k_h, v_h = (_seq_to_heads(x, group) for x in (q, k, v))
    index = _full_layout_index(q.shape[2], size, q.device)
    docs = _full_layout_doc_ids(doc_ids, group)
    mask = attention_mask(index, index, docs, docs)
    out = _sdpa(q_h, repeat_kv(k_h, groups), repeat_kv(v_h, groups), mask, scale)
    return _heads_to_seq(out, group)


# ---- model integration ---------------------------------------------------------------------------
CP_FUNCTIONS = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "ulysses": ulysses_attention,
}


class ContextParallelAttentionCore(nn.Module):
    """Drop-in `attention.core` that attends across the CP group with the chosen kind.

    forward(q [B,Hq,T/cp,Dh], k, v [B,Hkv,T/cp,Dh], positions_ctx) -> [B,Hq,T/cp,Dh]; the doc ids
    of the local tokens are read from `positions_ctx` (attribute or key `doc_ids`).
    """

    def __init__(self, group: dist.ProcessGroup, kind: str = "ring", kernel: str = "auto"):
        super().__init__()
        if kind not in CP_FUNCTIONS:
            raise ValueError(f"cp kind must be one of {tuple(CP_FUNCTIONS)}, got {kind!r}")
        self.group, self.kind, self.kernel = group, kind, kernel

    def forward(self, q, k, v, positions_ctx=None):
        doc_ids = _doc_ids_of(positions_ctx)
        if self.kind == "ring":
            return ring_attention(q, k, v, doc_ids, self.group, kernel=self.kernel)
        return CP_FUNCTIONS[self.kind](q, k, v, doc_ids, self.group)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, cp={dist.get_world_size(self.group)}"


def _doc_ids_of(positions_ctx: Any) -> torch.Tensor | None:
    if positions_ctx is None:
        return None
    if isinstance(positions_ctx, dict):
        return positions_ctx.get("doc_ids")
    return getattr(positions_ctx, "doc_ids", None)


def apply_context_parallel(model: nn.Module, cp_mesh: Any, kind: str = "ring") -> nn.Module:
    """Swap every block's `attention.core` for a context-parallel one over `cp_mesh` (1-D mesh or
    ProcessGroup). Works on whole models and on pipeline chunks. Returns the model."""
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    for block in model.layers.values():
        block.attention.core = ContextParallelAttentionCore(group, kind)
    return model
