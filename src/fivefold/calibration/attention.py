"""Attention: the model's core at each TP split, a CP rank's block attention, the device grid."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

from fivefold.calibration.matmul import tp_degrees
from fivefold.calibration.timing import (
    TORCH_DTYPES,
    Budget,
    backward_time_s,
    measured_device,
    randn_on_device,
    typical_time_s,
)
from fivefold.model.attention import AttentionCore, packed_kernel
from fivefold.model.attention_blocks import block_attention
from fivefold.model.document_layout import DocumentLayout, document_blocks
from fivefold.parallel.context_parallel import local_chunks, rank_order_chunks
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import Attention


# ---- attention ----------------------------------------------------------------------------------
def attention_passes(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    budget: Budget,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, float]:
    """(forward, backward) seconds of the model's attention core at this shape: one document
    per row (most rows of packed data; SDPA's causal kernel, GQA native), q/k/v laid out
    [B, T, H, Dh] in memory as the projections leave them."""
    core = AttentionCore()
    gen = torch.Generator().manual_seed(0)

    def leaf(h: int) -> torch.Tensor:
        return randn_on_device(gen, batch, seq, h, head_dim).to(dtype).requires_grad_(True)

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    grad = randn_on_device(gen, batch, heads, seq, head_dim).to(dtype)

    def forward() -> torch.Tensor:
        return core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)

    return typical_time_s(forward, budget), backward_time_s(forward, grad, budget)


PACKED_DOCUMENTS = 4  # documents per row in the packed measurements (equal lengths)
FLEX_QUICK_SEQ = 8192  # `--quick`: compiled FlexAttention at this one-row shape alone


def packed_layout(batch: int, seq: int) -> DocumentLayout:
    """`batch` rows of `seq` tokens, each `PACKED_DOCUMENTS` documents of seq / that many tokens,
    with the host offsets a data loader hands over (no device read-back)."""
    length = seq // PACKED_DOCUMENTS
    device = measured_device()
    ids = torch.arange(seq, device=device) // length
    doc_ids = (ids + PACKED_DOCUMENTS * torch.arange(batch, device=device)[:, None]).long()
    offsets = np.arange(0, batch * seq + 1, length, dtype=np.int32)
    return DocumentLayout(doc_ids, batch, seq, offsets)


def packed_attention_passes(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    budget: Budget,
    dtype: torch.dtype,
    kernel: str,
) -> tuple[float, float]:
    """(forward, backward) seconds of packed rows (`packed_layout`) through the kernel a run
    uses there (`fivefold.model.attention.packed_kernel`): "flex" (FlexAttention compiled, its
    BlockMask built before), "varlen" or "document_attention" (the model's core run eagerly)."""
    gen = torch.Generator().manual_seed(0)
    docs = packed_layout(batch, seq)

    def leaf(h: int) -> torch.Tensor:
        return randn_on_device(gen, batch, seq, h, head_dim).to(dtype).requires_grad_(True)

    q, k, v = (x.transpose(1, 2) for x in (leaf(heads), leaf(kv_heads), leaf(kv_heads)))
    grad = randn_on_device(gen, batch, heads, seq, head_dim).to(dtype)
    if kernel == "flex":
        mask = docs.flex_block_mask(q.device)
        flex = torch.compile(flex_attention)

        def forward() -> torch.Tensor:
            return flex(q, k, v, block_mask=mask, enable_gqa=kv_heads != heads)
    else:
        core = AttentionCore()

        def forward() -> torch.Tensor:
            return core(q, k, v, docs)

    return typical_time_s(forward, budget), backward_time_s(forward, grad, budget)


def packed_kernels(kind: str, dtype: torch.dtype) -> list[str]:
    """The kernels runs use on several documents per row on a device of `kind`: eager and,
    on CUDA, compiled (`packed_kernel`)."""
    device = torch.device(kind)
    return sorted({packed_kernel(device, dtype, compiling) for compiling in (False, True)})


def measure_packed_attention_grid(
    kind: str, threads: int, budget: Budget, quick: bool, dtype: str = "fp32"
) -> Iterator[Attention]:
    """The packed-document kernels over the device's `attention_grid` (compiled FlexAttention,
    each shape a compile, at its one-row shapes only, `--quick` at `FLEX_QUICK_SEQ` alone). A
    row is one document's shape (seq the document's length, batch the documents) and its rate
    counts the pairs each document's causal mask keeps, so it reads beside the one-document
    SDPA row of that shape."""
    for kernel in packed_kernels(kind, TORCH_DTYPES[dtype]):
        for batch, heads, kv, seq, dim in attention_grid(kind, quick):
            few = batch > 1 or (quick and seq != FLEX_QUICK_SEQ)
            if seq % PACKED_DOCUMENTS or (kernel == "flex" and few):
                continue
            passes = packed_attention_passes(
                batch, heads, kv, seq, dim, budget, TORCH_DTYPES[dtype], kernel
            )
            docs, length = batch * PACKED_DOCUMENTS, seq // PACKED_DOCUMENTS
            flops = attention_flops(docs, heads, length, dim)
            yield Attention(
                dtype, threads, docs, heads, kv, length, dim, 1, flops / passes[0],
                2 * flops / passes[1], kernel,
            )  # fmt: skip


def cp_rank_blocks(batch: int, seq: int, cp: int) -> list:
    """CP rank 0's attention blocks (one document per row): its two load-balanced query chunks
    against the keys of every rank laid out in rank order, as the runtime builds them."""
    chunk = seq // (2 * cp)
    layout = DocumentLayout(None, batch, seq)
    return document_blocks(local_chunks(0, cp, chunk), rank_order_chunks(cp, chunk), layout)


def cp_attention_passes(
    batch: int, heads: int, kv_heads: int, seq: int, cp: int, head_dim: int, budget: Budget
) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's share of context-parallel attention over a
    `seq`-token sequence split `cp` ways, as the runtime computes it
    (`fivefold.parallel.context_parallel`): the rank's two load-balanced chunks of queries
    against every chunk of keys, one document per row, through the model's block kernels
    (causal on the diagonal, full below) and their log-sum-exp merges. Rank 0's blocks; every
    rank does the same work. No transfer is timed."""
    chunk = seq // (2 * cp)
    blocks = cp_rank_blocks(batch, seq, cp)
    gen = torch.Generator().manual_seed(0)

    def leaf(tokens: int, h: int) -> torch.Tensor:
        return randn_on_device(gen, batch, tokens, h, head_dim).requires_grad_(True)

    q, k, v = leaf(2 * chunk, heads), leaf(seq, kv_heads), leaf(seq, kv_heads)
    grad = randn_on_device(gen, batch, heads, 2 * chunk, head_dim)

    def forward() -> torch.Tensor:
        return block_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), blocks)

    return typical_time_s(forward, budget), backward_time_s(forward, grad, budget)


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, cp: int = 1) -> float:
    """Causal forward FLOPs of one rank's `seq` tokens of a sequence `cp` times as long: QK^T
    and AV over cp * seq / 2 keys per query on average (the planner's count)."""
    return 4.0 * batch * seq * (cp * seq / 2) * head_dim * heads


# Model-independent attention shapes per device kind: (heads, kv heads), the batch sizes, the
# sequence lengths and head widths, at most `ATTENTION_GRID_TOKENS` tokens per batch
# (`Measured.attention_flops_per_s` interpolates over (seq, head width, batch x heads) in log
# space: a CPU's kernels gain much from more rows of queries).
ATTENTION_GRID = {
    ("cpu", False): ((8, 4), (1, 4), (128, 512, 2048), (32, 128)),
    ("cpu", True): ((8, 4), (1, 4), (256, 1024), (64,)),
    ("cuda", False): ((16, 4), (1, 4), (1024, 4096, 16384, 65536), (64, 128)),
    ("cuda", True): ((16, 4), (1, 4), (1024, 8192, 65536), (128,)),
}
ATTENTION_GRID_TOKENS = {"cpu": 2048, "cuda": 65536}


def attention_grid(kind: str, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(batch, heads, kv heads, seq, head_dim) of the device's attention grid."""
    (heads, kv), batches, seqs, dims = ATTENTION_GRID[kind, quick]
    cap = ATTENTION_GRID_TOKENS[kind]
    return [(b, heads, kv, s, d) for b in batches for s in seqs for d in dims if b * s <= cap]


def measure_attention_grid(
    kind: str, threads: int, budget: Budget, quick: bool, dtype: str = "fp32"
) -> Iterator[Attention]:
    """The attention core (cp = 1) over the device's `attention_grid`."""
    for batch, heads, kv, seq, dim in attention_grid(kind, quick):
        fwd, bwd = attention_passes(batch, heads, kv, seq, dim, budget, TORCH_DTYPES[dtype])
        flops = attention_flops(batch, heads, seq, dim)
        yield Attention(dtype, threads, batch, heads, kv, seq, dim, 1, flops / fwd, 2 * flops / bwd)


def measure_attention(
    model: ModelSpec,
    plan: ParallelPlan,
    ranks: int,
    threads: int,
    budget: Budget,
    quick: bool,
    dtype: str = "fp32",
) -> Iterator[Attention]:
    """The single-process core at each TP split (cp = 1 rows) and, up to `ranks`, the block
    attention of ring / all-gather context parallelism at each CP split (cp > 1 rows; on a
    CPU only: a GPU's CP blocks are not measured)."""
    s = model.seq_len
    cps = [1] if quick else [c for c in (1, 2, 4) if c <= max(1, ranks) and s % (2 * c) == 0]
    cps = cps if measured_device().type == "cpu" else [1]
    for tp in tp_degrees(model, ranks):
        for cp in cps:
            heads, kv, seq = model.heads // tp, model.kv_heads // tp, s // cp
            shape = (plan.micro_batch, heads, kv)
            if cp == 1:
                fwd, bwd = attention_passes(*shape, s, model.head_dim, budget, TORCH_DTYPES[dtype])
            else:
                fwd, bwd = cp_attention_passes(*shape, s, cp, model.head_dim, budget)
            flops = attention_flops(plan.micro_batch, heads, seq, model.head_dim, cp)
            yield Attention(
                dtype, threads, plan.micro_batch, heads, kv, seq, model.head_dim, cp,
                flops / fwd, 2 * flops / bwd,
            )  # fmt: skip
