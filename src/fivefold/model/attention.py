"""Grouped-query attention with RoPE over packed documents, without a T x T mask: a token attends
to the earlier tokens of its own document (runs of equal `doc_ids`). The core picks per call:

- one document per row: SDPA `is_causal=True`, one call;
- CUDA under `torch.compile`: FlexAttention with the batch's document-causal `BlockMask`;
- CUDA eager, fp16/bf16: `varlen_attn` over the packed tokens (K/V heads repeated where the
  installed torch lacks GQA there, `torch_features.varlen_supports_gqa`);
- otherwise (CPU, CUDA fp32): SDPA once per document inside the `fivefold::document_attention`
  custom op (with its backward), one opaque node to `torch.compile`, so a new packing neither
  breaks the graph nor recompiles. SDPA takes one sequence per call and FlexAttention has no
  backward on CPU, hence the op.

A layer with a sliding window (`ModelSpec.layer_window`) passes it to its core, and each path
applies it (`fivefold.model.sliding_window`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from fivefold.model.attention_blocks import (
    block_backward,
    blocks_forward,
    expand_heads,
    heads_last_buffer,
    zero_grads,
)
from fivefold.model.attention_variants import head_norms
from fivefold.model.document_layout import (
    Block,
    Chunk,
    DocumentLayout,
    doc_ids_cache,
    document_blocks,
)
from fivefold.model.rope import apply_rope
from fivefold.model.sliding_window import effective_window, varlen_window, windowed_sdpa
from fivefold.model.torch_features import has, varlen_supports_gqa


def _varlen(q, k, v, docs: DocumentLayout, window: int = 0) -> torch.Tensor:
    """CUDA: causal attention per document with `varlen_attn` (within `window` keys when > 0);
    q [B,Hq,T,Dh] -> [B,Hq,T,Dh]."""
    from torch.nn.attention.varlen import varlen_attn  # here: it imports torch._dynamo (3 s)

    batch, heads, seq, dim = q.shape
    cu_seqlens, max_len = docs.cu_seqlens(q.device)
    gqa = {}
    if k.shape[1] != heads:
        if varlen_supports_gqa():
            gqa = {"enable_gqa": True}
        else:  # torch 2.11: no GQA in varlen_attn, each K/V head repeated per query group
            k, v = expand_heads(k, heads), expand_heads(v, heads)

    def packed(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, Dh] -> [B*T, H, Dh]
        return x.transpose(1, 2).reshape(batch * seq, x.shape[1], dim)

    out = varlen_attn(
        packed(q), packed(k), packed(v), cu_seqlens, cu_seqlens, max_len, max_len,
        window_size=varlen_window(window), **gqa,
    )  # fmt: skip
    return out.view(batch, seq, heads, dim).transpose(1, 2)


def flex_document_attention(q, k, v, docs: DocumentLayout, window: int = 0) -> torch.Tensor:
    """Causal attention within documents (and `window` keys when > 0) by FlexAttention with the
    batch's `BlockMask`: q [B,Hq,T,Dh], k, v [B,Hkv,T,Dh] -> [B,Hq,T,Dh]; GQA native. Under
    `torch.compile` (CUDA) it becomes one fused kernel with its backward; run eagerly it is
    torch's reference (forward only on CPU), which the tests use to check it."""
    mask = docs.flex_block_mask(q.device, window)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _whole_sequence_blocks(doc_ids: torch.Tensor, window: int = 0) -> list[Block]:
    """The document blocks of the full rows of `doc_ids` [B, T] within a sliding `window` of
    keys when > 0 (cached with the tensor)."""
    cache = doc_ids_cache(doc_ids)
    key = ("blocks", window)
    if key not in cache:
        batch, seq = doc_ids.shape
        whole = [Chunk(0, 0, seq)]
        layout = DocumentLayout(doc_ids, batch, seq)
        cache[key] = document_blocks(whole, whole, layout, window)
    return cache[key]


@torch.library.custom_op("fivefold::document_attention", mutates_args=())
def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within the documents of `doc_ids` [B, T] (runs of equal ids), within
    `window` keys when > 0: q [B,Hq,T,Dh], k, v [B,Hkv,T,Dh] -> (out [B,Hq,T,Dh] whose memory
    is [B,T,Hq,Dh], lse fp32 [B,Hq,T]). A custom op so that `torch.compile` keeps it as one
    opaque node: the document spans are read from `doc_ids` when it runs, so a new packing
    never recompiles and the block's graph never breaks around attention."""
    blocks = _whole_sequence_blocks(doc_ids, window)
    return blocks_forward(q, k, v, blocks, q.shape[-1] ** -0.5)


@document_attention.register_fake
def _document_attention_fake(q, k, v, doc_ids, window=0):
    batch, heads, seq, _ = q.shape
    return heads_last_buffer(q, heads, seq, q.dtype), q.new_empty(
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
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `document_attention`, laid out like q and k ([B, T, H, Dh] memory)."""
    grads = zero_grads(q, k)
    for block in _whole_sequence_blocks(doc_ids, window):
        block_backward(dout, q, k, v, out, lse, block, q.shape[-1] ** -0.5, grads)
    dq, dk, dv = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@document_attention_backward.register_fake
def _document_attention_backward_fake(dout, q, k, v, out, lse, doc_ids, window=0):
    return (
        heads_last_buffer(q, q.shape[1], q.shape[2], q.dtype),
        heads_last_buffer(k, k.shape[1], k.shape[2], k.dtype),
        heads_last_buffer(v, v.shape[1], v.shape[2], v.dtype),
    )


def _document_attention_setup(ctx, inputs, output) -> None:
    q, k, v, doc_ids, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_ids)
    ctx.window = window


def _document_attention_grad(ctx, dout, _dlse):
    q, k, v, out, lse, doc_ids = ctx.saved_tensors
    dq, dk, dv = document_attention_backward(dout, q, k, v, out, lse, doc_ids, ctx.window)
    return dq, dk, dv, None, None


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

    `window` > 0: each query sees at most that many keys (itself included), 0 all earlier ones
    (`fivefold.model.sliding_window`). `docs` None means one document per row. GQA never
    copies K/V per query head (but in eager CUDA on a torch whose `varlen_attn` lacks GQA).
    Under `torch.compile` nothing here breaks the graph: one-document rows are SDPA in the
    graph, packed rows FlexAttention on CUDA (its `BlockMask` built before the block,
    `fivefold.parallel.compile`) and the `document_attention` op on CPU.
    """

    def __init__(self, window: int = 0) -> None:
        super().__init__()
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentLayout | None
    ) -> torch.Tensor:
        window = effective_window(self.window, q.shape[2])
        kernel = packed_kernel(q.device, q.dtype, torch.compiler.is_compiling())
        if docs is None or docs.single_document:
            if not window:
                gqa = k.shape[1] != q.shape[1]
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            if kernel != "varlen":  # the band as a [T, T] mask
                return windowed_sdpa(q, k, v, window)
            docs = docs or DocumentLayout(None, q.shape[0], q.shape[2])  # flash's own window
        if kernel == "flex":
            return flex_document_attention(q, k, v, docs, window)
        if kernel == "varlen":
            return _varlen(q, k, v, docs, window)
        return document_attention(q, k, v, docs.doc_ids, window)[0]

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window else ""


class Attention(nn.Module):
    """x [B, T, D] -> [B, T, D]: project to q/k/v heads, RoPE on q and k, core, output projection.

    The number of heads is inferred from the projected widths at forward time (width / head_dim),
    so tensor parallelism can shard `wq`/`wk`/`wv` column-wise and `wo` row-wise by heads.
    `rope` is the (cos, sin) pair of `rope_cos_sin`, computed once per forward by the model.
    Variants (`fivefold.model.attention_variants`): `qkv_bias` gives `wq`/`wk`/`wv` biases;
    `qk_norm_eps` adds `q_norm`/`k_norm`, RMSNorms of each head applied before RoPE; `window`
    > 0 a sliding window of that many keys (the core's, `fivefold.model.sliding_window`).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.head_dim, self.window = head_dim, window
        self.wq = nn.Linear(dim, heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm, self.k_norm = head_norms(head_dim, qk_norm_eps)
        self.core = AttentionCore(window)

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
        q, k = self._heads(self.wq(x)), self._heads(self.wk(x))  # [B, T, Hq | Hkv, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self._heads(self.wv(x))
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
        return self.wo(out.transpose(1, 2).flatten(2))  # a view when out is [B, T, H, Dh] memory
