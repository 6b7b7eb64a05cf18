"""`fivefold calibrate`: measure the machine at hand into a device profile (spec/profile.py).

What is measured, in one process per thread count (1 and all cores on a CPU), each kernel timed
as the lower quartile of repeats after a warm-up (`typical_time_s`: on a machine shared with
other work the slow repeats are the other work's, not the kernel's), each repeat starting from
cold caches (`flush_caches`: in a training step the rest of the model passes through the caches
between two uses of a weight; warm-cache GEMMs of these sizes run about 10 % faster than in the
model):
- matmul: every GEMM the model runs (wq, wk, wv, wo, w1, w3, w2, the LM head; the router and
  shared experts for MoE) at the recipe's tokens per micro-batch (and half of them, what context
  parallelism leaves) and at each tensor-parallel split up to the ranks, in all three passes with
  the operand layouts autograd uses: forward x W^T, input gradient g W, weight gradient g^T x;
  per dtype (fp32; bf16 only where the CPU has native bf16, `bf16_support`);
- grouped matmul: a MoE layer's experts as `torch._grouped_mm` runs them (w1, w3, w2; all
  three passes) at each expert-parallel split, at the model's expert shapes;
- attention: the model's own attention core (causal SDPA with native GQA, one document per
  row), forward and backward, at each TP split; and one rank's share of context-parallel
  attention at each CP split (the runtime's block kernels over its load-balanced chunks, with
  their log-sum-exp merges);
- bandwidth: the block's element-wise work (norms, RoPE, SwiGLU, residual adds), the
  cross-entropy loss and AdamW (with clipping and zeroing), each in the byte accounting of
  `fivefold.planner.compute`, so the planner's bytes over these rates give time; alone here,
  and on every rank at once in the collective benchmark's worlds (`calibrate_comm`), since
  the ranks of a run share the memory bandwidth;
- overhead: what one more layer adds at a shape where its arithmetic is negligible (Python,
  autograd, each op's dispatch): dense and MoE layers, and the extra of tensor parallelism
  (DTensor), of expert parallelism on a MoE layer and of a data-parallel unit (FSDP2's hooks
  for ZeRO-3, ZeRO-1/2 and `replicate` for ZeRO-0), measured on a one-rank mesh.
The collectives run over real process groups (`fivefold.parallel.calibrate_comm`).
Besides the model's own shapes, a model-independent grid of GEMM and attention shapes
(`DEVICE_GRID`, `ATTENTION_GRID`) that the planner interpolates any model among.

On a GPU (`use_device("cuda")`, `cuda_steps`) kernels are timed by CUDA events after an L2
flush: GEMMs in bf16 and FP8 (compute capability 8.9+), grouped experts and attention in bf16,
the bandwidths in HBM (fused AdamW), a layer's launch cost; the rows carry threads = 1.

Written by hand: PyTorch has benchmark utilities but nothing that measures a machine into the
planner's terms.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fivefold.model.attention import AttentionCore
from fivefold.model.loss import cross_entropy_loss
from fivefold.model.norms import RMSNorm
from fivefold.model.rope import apply_rope, rope_cos_sin
from fivefold.model.transformer import Transformer, TransformerBlock
from fivefold.planner.compute import (
    ComputeOptions,
    layer_elementwise_bytes,
    optimizer_bytes_per_param,
)
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.profile import (
    LAYOUTS,
    Attention,
    Bandwidth,
    DeviceProfile,
    GroupedMatmul,
    Matmul,
    Overhead,
    available_cores,
)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Budget:
    """How long to measure: repeats per kernel and the seconds that may stretch them."""

    min_repeats: int = 3
    max_repeats: int = 15
    seconds: float = 0.15  # per kernel, after the warm-up


QUICK = Budget(2, 4, 0.03)
GRID = Budget(2, 4, 0.02)  # the device grid's points: many, and interpolated between


def lower_quartile(times: list[float]) -> float:
    """The median of the faster half of `times`."""
    ordered = sorted(times)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}  # more than the last-level cache
_flush_buffer: torch.Tensor | None = None
_device = torch.device("cpu")  # where kernels are measured (`use_device`)


def use_device(device: str | torch.device) -> None:
    """Measure on `device` from now on ("cpu", or "cuda": CUDA events time each kernel)."""
    global _device, _flush_buffer
    _device, _flush_buffer = torch.device(device), None
    if _device.type == "cuda" and _device.index is None:
        _device = torch.device("cuda", torch.cuda.current_device())


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal values on the measuring device; a GPU's are drawn there (its operands
    are too large to draw on the host quickly), from torch's global generator."""
    if _device.type == "cpu":
        return torch.randn(*shape, generator=gen)
    return torch.randn(*shape, device=_device)


def flush_caches() -> None:
    """Write a buffer larger than the last-level cache (L2 on a GPU), evicting the operands."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.zeros(FLUSH_BYTES[_device.type] // 4, device=_device)
    _flush_buffer.add_(1.0)


def timed_s(fn: Callable[[], object]) -> float:
    """Seconds of one `fn()`: on a GPU between two CUDA events around its kernels (the host
    only queues them), on a CPU by `clock()`."""
    if _device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    now = clock()
    tick = now()
    fn()
    return now() - tick


def clock() -> Callable[[], float]:
    """The clock kernels are timed with: this thread's CPU time when torch runs one thread (the
    kernel runs on it, and time other processes take from the core is not counted, so a busy
    machine measures what an idle one would), else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def typical_time_s(fn: Callable[[], object], budget: Budget) -> float:
    """Lower-quartile seconds of `fn()` over the budget's repeats, after one warm-up call."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < budget.min_repeats or (
        len(times) < budget.max_repeats and time.perf_counter() - started < budget.seconds
    ):
        flush_caches()
        times.append(timed_s(fn))
    return lower_quartile(times)


# ---- the machine --------------------------------------------------------------------------------
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return set(match.group(1).split()) if match else set()


def bf16_support() -> str:
    """ "native" when the CPU has AMX-BF16 or AVX512-BF16 (else torch emulates bf16 matmuls,
    often many times slower than fp32: "emulated")."""
    return "native" if cpu_flags() & {"amx_bf16", "avx512_bf16"} else "emulated"


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def measured_device_name() -> str:
    """The name of the device kernels are measured on: the GPU's, else the CPU's."""
    return torch.cuda.get_device_name(_device) if _device.type == "cuda" else cpu_name()


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def thread_counts(cores: int) -> list[int]:
    """The per-rank thread counts runs on this machine use: 1 (many ranks) and all cores."""
    return sorted({1, max(1, cores)})


# ---- the shapes of the model at hand ---------------------------------------------------------
def tp_degrees(model: ModelSpec, ranks: int) -> list[int]:
    """Tensor-parallel splits up to `ranks` that divide the heads, kv heads and widths."""
    out = []
    t = 1
    while t <= max(1, ranks):
        if model.heads % t == 0 and model.kv_heads % t == 0 and model.ffn % t == 0:
            out.append(t)
        t *= 2
    return out


def linear_shapes(model: ModelSpec, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(tokens, out, in) of every linear layer of one block and the head, split `tp` ways."""
    h, q, kv = model.hidden, model.q_width // tp, model.kv_width // tp
    out = [(tokens, q, h), (tokens, kv, h), (tokens, h, q), (tokens, model.vocab // tp, h)]
    if model.is_moe:  # the routed experts are grouped matmuls (`grouped_shapes`)
        fe = model.expert_ffn // tp
        out += [(tokens, model.experts, h)]
        if model.shared_experts:
            width = model.shared_experts * fe
            out += [(tokens, width, h), (tokens, h, width)]
    if not model.is_moe or model.dense_layers:
        f = model.ffn // tp
        out += [(tokens, f, h), (tokens, h, f)]
    return out


def gemm_shapes(model: ModelSpec, plan: ParallelPlan, ranks: int, quick: bool) -> list[tuple]:
    """(m, n, k, layout) of the three passes of every linear at the recipe's micro-batch."""
    full = plan.micro_batch * model.seq_len
    token_counts = [full] if quick else sorted({full, max(1, full // 2)})
    shapes = set()
    for tokens in token_counts:
        for tp in tp_degrees(model, ranks):
            for t, o, i in linear_shapes(model, tokens, tp):
                shapes |= {(t, o, i, "nt"), (t, i, o, "nn"), (o, i, t, "tn")}
    return sorted(shapes)


# Model-independent GEMM shapes per device kind (m, and n = k sides): with them every model's
# shapes fall among measured ones, so one profile serves every model (`Measured.gemm_flops_per_s`
# interpolates in log space). A CPU's sides stop where one GEMM takes about a second.
DEVICE_GRID = {
    ("cpu", False): ((128, 512, 2048), (128, 512, 2048)),
    ("cpu", True): ((256, 2048), (256, 2048)),
    ("cuda", False): ((256, 1024, 4096, 16384), (256, 1024, 4096, 16384)),
    ("cuda", True): ((512, 4096, 16384), (512, 2048, 8192)),
}


def device_grid_shapes(kind: str, quick: bool) -> list[tuple]:
    """(m, n, k, layout) of the device grid: every m with every (n, k), in each layout."""
    ms, sides = DEVICE_GRID[kind, quick]
    return sorted((m, n, k, layout) for m in ms for n in sides for k in sides for layout in LAYOUTS)


def _operands(m: int, n: int, k: int, layout: str, dtype: torch.dtype):
    """Tensors laid out as autograd has them for that pass, and the matmul to time."""
    gen = torch.Generator().manual_seed(0)
    if layout == "nt":  # forward: x [m, k] @ W[n, k]^T
        a, b = _rand(gen, m, k), _rand(gen, n, k)
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b.t())
    if layout == "nn":  # input gradient: g [m, k] @ W [k, n]
        a, b = _rand(gen, m, k), _rand(gen, k, n)
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b)
    a, b = _rand(gen, k, m), _rand(gen, k, n)  # g^T x
    a, b = a.to(dtype), b.to(dtype)
    return lambda: torch.mm(a.t(), b)


def _fp8_operands(m: int, n: int, k: int):
    """An FP8 (e4m3) matmul as float8 training runs each of its three passes: `_scaled_mm` of a
    row-major [m, k] by a column-major [k, n] operand, tensor-wise scales, bf16 output."""
    a = torch.randn(m, k, device=_device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=_device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=_device)
    return lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def fp8_supported() -> bool:
    """FP8 matmuls run natively: a CUDA device of compute capability 8.9 or later (Ada,
    Hopper, Blackwell) and torch's `_scaled_mm`."""
    return (
        _device.type == "cuda"
        and torch.cuda.get_device_capability(_device) >= (8, 9)
        and hasattr(torch, "_scaled_mm")
        and hasattr(torch, "float8_e4m3fn")
    )


def measure_matmul(shape: tuple, dtype: str, threads: int, budget: Budget) -> Matmul:
    """One GEMM pass: (m, n, k) in `layout`'s operand layout (fp8: `_fp8_operands`, whose
    three passes share one kernel layout; the row keeps the pass's label)."""
    m, n, k, layout = shape
    fn = (
        _fp8_operands(m, n, k)
        if dtype == "fp8"
        else _operands(m, n, k, layout, TORCH_DTYPES[dtype])
    )
    seconds = typical_time_s(fn, budget)
    return Matmul(dtype, threads, m, n, k, layout, 2.0 * m * n * k / seconds)


# ---- grouped expert matmuls -------------------------------------------------------------------
def grouped_shapes(model: ModelSpec, plan: ParallelPlan, ranks: int, quick: bool) -> list[tuple]:
    """(groups, tokens, n, k) of a MoE layer's three expert projections (w1, w3 share a shape)
    at the recipe's micro-batch (and half of it, what CP leaves), for each expert-parallel split
    up to `ranks`: experts / ep groups over tokens x top_k routed rows (balanced routing)."""
    if not model.is_moe:
        return []
    full = plan.micro_batch * model.seq_len
    token_counts = [full] if quick else sorted({full, max(1, full // 2)})
    eps = [e for e in (1, 2, 4, 8) if e <= max(1, ranks) and model.experts % e == 0]
    h, fe = model.hidden, model.expert_ffn
    out = set()
    for tokens in token_counts:
        for ep in eps:
            groups, rows = model.experts // ep, tokens * model.top_k
            out |= {(groups, rows, fe, h), (groups, rows, h, fe)}
    return sorted(out)


def _grouped_operands(groups: int, tokens: int, n: int, k: int, layout: str, dtype):
    """`torch._grouped_mm` as the experts' autograd runs it (`fivefold.model.moe`): forward
    x [T, k] @ W[g, n, k]^T; input gradient g [T, n] @ W [g, n, k]; weight gradient
    g[T, n]^T @ x [T, k] per group -> [g, n, k]; `tokens` split evenly over the groups."""
    gen = torch.Generator().manual_seed(0)
    rows = max(1, tokens // groups)
    offs = torch.arange(1, groups + 1, dtype=torch.int32, device=_device) * rows
    x = _rand(gen, rows * groups, k).to(dtype)
    g = _rand(gen, rows * groups, n).to(dtype)
    w = _rand(gen, groups, n, k).to(dtype)
    if layout == "nt":
        return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if layout == "nn":
        return lambda: torch._grouped_mm(g, w, offs=offs)
    return lambda: torch._grouped_mm(g.t(), x, offs=offs)


def measure_grouped(shape: tuple, dtype: str, threads: int, budget: Budget) -> list:
    """The three passes of one grouped expert projection, as `GroupedMatmul` rows."""
    groups, tokens, n, k = shape
    rows = max(1, tokens // groups) * groups
    out = []
    for layout in LAYOUTS:
        fn = _grouped_operands(groups, tokens, n, k, layout, TORCH_DTYPES[dtype])
        seconds = typical_time_s(fn, budget)
        flops = 2.0 * rows * n * k
        out.append(GroupedMatmul(dtype, threads, groups, rows, n, k, layout, flops / seconds))
    return out


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
        return _rand(gen, batch, seq, h, head_dim).to(dtype).requires_grad_(True)

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    grad = _rand(gen, batch, heads, seq, head_dim).to(dtype)

    def forward() -> torch.Tensor:
        return core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)

    return typical_time_s(forward, budget), _backward_time(forward, grad, budget)


def _backward_time(forward: Callable[[], torch.Tensor], grad: torch.Tensor, budget: Budget):
    """Lower-quartile seconds of the backward alone of `forward()` (a fresh graph each time)."""
    times = []
    for _ in range(max(budget.min_repeats, 2) + 1):
        out = forward()
        flush_caches()
        times.append(timed_s(lambda out=out: out.backward(grad)))
    return lower_quartile(times[1:])


def cp_rank_blocks(batch: int, seq: int, cp: int) -> list:
    """CP rank 0's attention blocks (one document per row): its two load-balanced query chunks
    against the keys of every rank laid out in rank order, as the runtime builds them."""
    from fivefold.model.document_layout import DocumentLayout, document_blocks
    from fivefold.parallel.context_parallel import local_chunks, rank_order_chunks

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
    from fivefold.model.attention_blocks import block_attention

    chunk = seq // (2 * cp)
    blocks = cp_rank_blocks(batch, seq, cp)
    gen = torch.Generator().manual_seed(0)

    def leaf(tokens: int, h: int) -> torch.Tensor:
        return _rand(gen, batch, tokens, h, head_dim).requires_grad_(True)

    q, k, v = leaf(2 * chunk, heads), leaf(seq, kv_heads), leaf(seq, kv_heads)
    grad = _rand(gen, batch, heads, 2 * chunk, head_dim)

    def forward() -> torch.Tensor:
        return block_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), blocks)

    return typical_time_s(forward, budget), _backward_time(forward, grad, budget)


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
    cps = cps if _device.type == "cpu" else [1]
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


# ---- element-wise work, loss, optimizer ------------------------------------------------------
def elementwise_passes(model: ModelSpec, batch: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of one block's non-matmul, non-attention work as the model
    runs it: two RMSNorms, RoPE on q and k (tables shared by the layers, made once), SwiGLU
    (or GeLU), two residual adds; `batch` sequences of the model's length."""
    b, s, h, d = batch, model.seq_len, model.hidden, model.head_dim
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return _rand(gen, *shape).requires_grad_(True)

    norm1, norm2 = (RMSNorm(h, model.norm_eps).to(_device) for _ in range(2))
    x, attn, mlp = leaf(b, s, h), leaf(b, s, h), leaf(b, s, h)
    q, k = leaf(b, s, model.heads, d), leaf(b, s, model.kv_heads, d)
    gate, up = leaf(b, s, model.ffn), leaf(b, s, model.ffn)
    cos, sin = rope_cos_sin(torch.arange(s, device=_device).expand(b, s), d, model.rope_theta)

    def forward() -> list[torch.Tensor]:
        xn = norm1(x)
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        hidden = x + attn
        hn = norm2(hidden)
        act = F.silu(gate) * up if model.mlp == "swiglu" else F.gelu(gate)
        return [xn, qr, kr, hn, act, hidden + mlp]

    outs = forward()
    grads = [torch.randn_like(o) for o in outs]
    fwd = typical_time_s(forward, budget)
    times = []
    for _ in range(max(budget.min_repeats, 2) + 1):
        outs = forward()
        flush_caches()
        times.append(timed_s(lambda outs=outs: torch.autograd.backward(outs, grads)))
    return fwd, lower_quartile(times[1:])


def loss_passes(tokens: int, vocab: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of the fp32 cross entropy over [tokens, vocab] logits."""
    gen = torch.Generator().manual_seed(0)
    logits = _rand(gen, 1, tokens, vocab).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen).to(_device)
    fwd = typical_time_s(lambda: cross_entropy_loss(logits, labels), budget)
    return fwd, _backward_time(
        lambda: cross_entropy_loss(logits, labels), torch.tensor(1.0, device=_device), budget
    )


OPTIMIZER_MAX_PARAMS = 16_000_000  # cap on the parameters the optimizer benchmark allocates


def optimizer_time_s(model: ModelSpec, budget: Budget) -> tuple[float, int]:
    """(seconds, parameters) of AdamW (foreach, as training runs it) with gradient clipping and
    zeroing over tensors shaped like the model's: the embedding, the head and as many blocks as
    fit under `OPTIMIZER_MAX_PARAMS` (per-tensor costs matter for small models)."""
    block = [tuple(p.shape) for p in TransformerBlock(0, model).parameters()]
    per_block = sum(math.prod(s) for s in block)
    ends = [(model.vocab, model.hidden), (model.vocab, model.hidden), (model.hidden,)]
    room = OPTIMIZER_MAX_PARAMS - sum(math.prod(s) for s in ends)
    blocks = max(1, min(model.layers, room // per_block))
    gen = torch.Generator().manual_seed(0)
    params = [_rand(gen, *s) for s in ends + block * blocks]
    for p in params:
        p.requires_grad_(True)
        p.grad = _rand(gen, *p.shape)
    fused = {"fused": True} if _device.type == "cuda" else {}  # as training runs it there
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **fused)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for p in params:  # zero_grad(set_to_none=False) keeps the grads for the next repeat
            p.grad.zero_()

    return typical_time_s(step, budget), sum(p.numel() for p in params)


def measure_bandwidth(
    model: ModelSpec, plan: ParallelPlan, threads: int, budget: Budget, processes: int = 1
) -> list[Bandwidth]:
    """Bandwidths in the planner's byte accounting (`fivefold.planner.compute`); `processes`:
    how many local processes run this at once (`fivefold.parallel.calibrate_comm` runs it on
    every rank of its worlds, so the rows see memory bandwidth shared as a run shares it)."""
    dense = replace(model, experts=0, top_k=0, shared_experts=0, dense_layers=0)
    one = ParallelPlan(micro_batch=plan.micro_batch, precision="fp32")
    elem_bytes = layer_elementwise_bytes(dense, one, False, ComputeOptions())
    fwd, bwd = elementwise_passes(dense, plan.micro_batch, budget)
    tokens = plan.micro_batch * model.seq_len
    loss_f, loss_b = loss_passes(tokens, model.vocab, budget)
    logits = tokens * model.vocab
    opt_s, params = optimizer_time_s(dense, budget)
    return [
        Bandwidth("elementwise_forward", threads, processes, elem_bytes / fwd),
        Bandwidth("elementwise_backward", threads, processes, 2 * elem_bytes / bwd),
        Bandwidth("loss_forward", threads, processes, 10 * logits / loss_f),
        Bandwidth("loss_backward", threads, processes, 14 * logits / loss_b),
        Bandwidth("optimizer", threads, processes, params * optimizer_bytes_per_param(one) / opt_s),
    ]


# ---- fixed per-layer overhead ----------------------------------------------------------------
def tiny_like(model: ModelSpec, layers: int) -> ModelSpec:
    """`model` shrunk until its arithmetic is negligible (width 16, 8 tokens, 64 words) with the
    same op structure: MLP kind, experts, top-k and shared experts (a MoE layer's routing and
    its loop over experts cost per op, not per byte)."""
    return ModelSpec(
        f"tiny-{model.name}", layers, 16, 2, kv_heads=1, ffn=16, vocab=64, seq_len=8,
        mlp=model.mlp, experts=model.experts, top_k=model.top_k,
        expert_ffn=16 if model.is_moe else 0, shared_experts=model.shared_experts,
    )  # fmt: skip


@contextlib.contextmanager
def local_group() -> Iterator[DeviceMesh]:
    """A one-rank gloo process group (made here unless one exists) and its 1-D mesh: tensor
    parallelism and FSDP2 on it run the dispatch and hooks of a real run with no transfers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if made:
            dist.destroy_process_group()


def model_passes(model: nn.Module, batch: int, seq: int, budget: Budget) -> tuple[float, float]:
    """(forward, backward) seconds of a whole model on `batch` x `seq` tokens."""
    from torch.distributed.tensor import DTensor

    tokens = torch.zeros(batch, seq, dtype=torch.long, device=_device)

    def forward() -> torch.Tensor:
        out = model(tokens)
        return (out.to_local() if isinstance(out, DTensor) else out).sum()

    return typical_time_s(forward, budget), _backward_time(
        forward, torch.tensor(1.0, device=_device), budget
    )


def per_layer_s(
    build: Callable[[ModelSpec], nn.Module], spec: ModelSpec, budget: Budget, batch: int = 1
):
    """(forward, backward) seconds one more layer adds: a 3-layer model less a 1-layer one,
    halved (the embedding, head and loss cancel)."""
    one = model_passes(build(replace(spec, layers=1)).to(_device), batch, spec.seq_len, budget)
    three = model_passes(build(replace(spec, layers=3)).to(_device), batch, spec.seq_len, budget)
    return max(0.0, (three[0] - one[0]) / 2), max(0.0, (three[1] - one[1]) / 2)


def tp_extra_s(
    tp: Callable[[ModelSpec], nn.Module], dense: ModelSpec, budget: Budget, batch: int
) -> tuple[float, float]:
    """(forward, backward) seconds tensor parallelism adds to one layer, at the model's own
    shape (DTensor's redistributions copy activations, so part of the extra grows with them)
    when three layers fit under `OPTIMIZER_MAX_PARAMS`, else at the tiny shape."""
    layer = sum(p.numel() for p in TransformerBlock(0, dense).parameters())
    spec, b = (dense, batch) if 3 * layer <= OPTIMIZER_MAX_PARAMS else (tiny_like(dense, 1), 1)
    return paired_extra_s(Transformer, tp, spec, budget, b)


def paired_extra_s(
    base: Callable[[ModelSpec], nn.Module],
    variant: Callable[[ModelSpec], nn.Module],
    spec: ModelSpec,
    budget: Budget,
    batch: int = 1,
) -> tuple[float, float]:
    """(forward, backward) seconds `variant` adds to one layer over `base`, at `spec`'s shape:
    1- and 3-layer models of each, timed one pass each in turn, round after round; per round
    ((variant 3 - variant 1) - (base 3 - base 1)) / 2, and the median over the rounds. Other
    work on the machine slows the four alike within a round, so its drifts cancel (two
    separate per-layer figures subtracted swung by several ms per layer under load)."""
    from torch.distributed.tensor import DTensor

    tokens = torch.zeros(batch, spec.seq_len, dtype=torch.long, device=_device)
    models = [build(replace(spec, layers=n)) for build in (base, variant) for n in (1, 3)]

    def one_pass(model: nn.Module) -> tuple[float, float]:
        now = clock()
        tick = now()
        out = model(tokens)
        loss = (out.to_local() if isinstance(out, DTensor) else out).sum()
        forward = now() - tick
        flush_caches()
        tick = now()
        loss.backward()
        return forward, now() - tick

    for model in models:  # warm-up
        one_pass(model)
    rounds = []
    for _ in range(max(7, budget.min_repeats)):
        b1, b3, v1, v3 = (one_pass(m) for m in models)
        rounds.append(tuple(((v3[i] - v1[i]) - (b3[i] - b1[i])) / 2 for i in (0, 1)))
    fwd, bwd = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    return max(0.0, fwd), max(0.0, bwd)


def measure_overhead(
    model: ModelSpec,
    threads: int,
    budget: Budget,
    moe: ModelSpec | None = None,
    batch: int = 1,
) -> Overhead:
    """The fixed seconds of one layer, at a shape where its arithmetic is negligible: Python,
    autograd and the dispatch of each op (`per_layer_s`). Dense and MoE layers apart; and the
    extra of tensor parallelism (DTensor dispatch, sharding propagation and redistribution
    copies with sequence parallelism, `tp_extra_s`, at `batch` sequences) and of a
    data-parallel unit wrapped as the runtime wraps it for ZeRO-3, ZeRO-0 (`replicate`) and
    ZeRO-1/2 (`fully_shard` kept gathered after forward): their hooks; the copies around the
    collectives are counted by bytes in the planner; and of a MoE layer under expert
    parallelism (the all-to-all dispatcher, DTensor expert shards, the global load-balancing
    loss). Each extra paired against the plain model (`paired_extra_s`), all on a one-rank
    mesh, so no transfer is timed. The MoE layer is `moe`'s
    (default `model`'s; a dense model's MoE figures are its dense ones)."""
    from fivefold.parallel.expert_parallel import apply_expert_parallel
    from fivefold.parallel.tensor_parallel import apply_tensor_parallel

    full = replace(model, experts=0, top_k=0, shared_experts=0, expert_ffn=0, dense_layers=0)
    dense = tiny_like(full, 1)
    torch.manual_seed(0)
    plain_f, plain_b = per_layer_s(Transformer, dense, budget)
    moe = moe if moe is not None else model
    moe_f, moe_b = per_layer_s(Transformer, tiny_like(moe, 1), budget) if moe.is_moe else (
        plain_f, plain_b,
    )  # fmt: skip
    with local_group() as mesh:

        def tp(spec: ModelSpec) -> nn.Module:
            net = Transformer(spec)
            apply_tensor_parallel(net, mesh, spec, sequence_parallel=True)
            return net

        def wrapped(zero: int) -> Callable[[ModelSpec], nn.Module]:
            def build(spec: ModelSpec) -> nn.Module:
                net = Transformer(spec)
                for block in net.layers.values():
                    _wrap_unit(block, mesh, zero, reshard=zero == 3)
                _wrap_unit(net, mesh, zero, reshard=False)
                return net

            return build

        def ep(spec: ModelSpec) -> nn.Module:
            net = Transformer(spec)
            apply_expert_parallel(net, mesh, aux_group=mesh.get_group(), expert_grad_scale=1.0)
            return net

        tp_f, tp_b = tp_extra_s(tp, full, budget, batch)
        units = [paired_extra_s(Transformer, wrapped(z), dense, budget) for z in (3, 0, 1)]
        ep_extra = (
            paired_extra_s(Transformer, ep, tiny_like(moe, 1), budget) if moe.is_moe else (0, 0)
        )
    extra = [t for unit in units for t in unit]
    return Overhead(threads, plain_f, plain_b, moe_f, moe_b, tp_f, tp_b, *extra, *ep_extra)


def _wrap_unit(module: nn.Module, mesh: DeviceMesh, zero: int, reshard: bool) -> None:
    """Wrap `module` as the runtime does for ZeRO `zero` (`fivefold.parallel.data_parallel`):
    FSDP2's `replicate` for ZeRO-0, else `fully_shard`."""
    from torch.distributed.fsdp import fully_shard

    if zero == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=mesh)
    else:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)


# ---- all compute measurements --------------------------------------------------------------
@dataclass
class ComputeTables:
    matmul: list[Matmul]
    grouped_matmul: list[GroupedMatmul]
    attention: list[Attention]
    bandwidth: list[Bandwidth]
    overhead: list[Overhead]


def compute_steps(
    model: ModelSpec,
    plan: ParallelPlan,
    ranks: int,
    quick: bool,
    bf16: str,
    also: tuple[ModelSpec, ...] = (),
):
    """The measurements to make, as (description, thunk returning rows) in order. `also`:
    further models whose GEMM shapes, attention and (MoE) layer overhead are measured too,
    for runs of several models on one profile; the bandwidths are `model`'s."""
    if _device.type == "cuda":
        return cuda_steps(model, plan, ranks, quick, also)
    budget = QUICK if quick else Budget()
    cores = available_cores()
    dtypes = ["fp32"] + (["bf16"] if bf16 == "native" and not quick else [])
    models = [model, *also]
    own = {s for m in models for s in gemm_shapes(m, plan, ranks, quick)}
    shapes = sorted(own | set(device_grid_shapes("cpu", quick)))
    grouped = sorted({s for m in models for s in grouped_shapes(m, plan, ranks, quick)})
    moe = next((m for m in models if m.is_moe), model)
    steps: list[tuple[str, Callable[[], list]]] = []
    for threads in thread_counts(cores):

        def at(fn: Callable[[], list], n: int = threads) -> Callable[[], list]:
            def run() -> list:
                torch.set_num_threads(n)
                return fn()

            return run

        for dtype in dtypes:
            for shape in shapes:
                label = f"matmul {dtype} {shape[0]}x{shape[1]}x{shape[2]} {shape[3]}, {threads}t"
                steps.append(
                    (
                        label,
                        at(
                            lambda s=shape, d=dtype, t=threads: [
                                measure_matmul(s, d, t, budget if s in own else GRID)
                            ]
                        ),
                    )
                )
            for shape in grouped:
                label = f"grouped matmul {dtype} {shape[0]} x {shape[1]}x{shape[2]}x{shape[3]}"
                steps.append(
                    (
                        f"{label}, {threads}t",
                        at(lambda s=shape, d=dtype, t=threads: measure_grouped(s, d, t, budget)),
                    )
                )
        steps.append(
            (
                f"attention grid, {threads}t",
                at(lambda t=threads: list(measure_attention_grid("cpu", t, GRID, quick))),
            )
        )
        for m in models:
            steps.append(
                (
                    f"attention {m.name}, {threads}t",
                    at(
                        lambda t=threads, m=m: list(
                            measure_attention(m, plan, ranks, t, budget, quick)
                        )
                    ),
                )
            )
        steps.append(
            (
                f"bandwidth, {threads}t",
                at(lambda t=threads: measure_bandwidth(model, plan, t, budget)),
            )
        )
        steps.append(
            (
                f"overhead, {threads}t",
                at(lambda t=threads: [measure_overhead(model, t, budget, moe, plan.micro_batch)]),
            )
        )
    return steps


def cuda_steps(
    model: ModelSpec, plan: ParallelPlan, ranks: int, quick: bool, also: tuple = ()
) -> list[tuple[str, Callable[[], list]]]:
    """`compute_steps` on a GPU (rows at threads = 1; training there runs bf16-mixed): the
    device grid and the models' GEMMs in bf16 and, where it runs natively, FP8; the experts'
    grouped matmuls in bf16; attention (the grid and each model's, bf16, SDPA as the model
    calls it); the element-wise, loss and optimizer bandwidths (fused AdamW) in HBM; the
    fixed cost of a dense and a MoE layer (kernel launches of a tiny model). Not measured
    there: CP block attention and the extra of TP, ZeRO and EP units (0 in the profile)."""
    budget = QUICK if quick else Budget()
    models = [model, *also]
    shapes = sorted(
        {s for m in models for s in gemm_shapes(m, plan, ranks, quick)}
        | set(device_grid_shapes("cuda", quick))
    )
    grouped = sorted({s for m in models for s in grouped_shapes(m, plan, ranks, quick)})
    moe = next((m for m in models if m.is_moe), model)
    steps: list[tuple[str, Callable[[], list]]] = []
    for dtype in ["bf16"] + (["fp8"] if fp8_supported() else []):
        for shape in shapes:
            if dtype == "fp8" and any(x % 16 for x in shape[:3]):  # `_scaled_mm`'s rule
                continue
            steps.append(
                (
                    f"matmul {dtype} {shape[0]}x{shape[1]}x{shape[2]} {shape[3]}",
                    lambda s=shape, d=dtype: [measure_matmul(s, d, 1, budget)],
                )
            )
    for shape in grouped:
        steps.append(
            (
                f"grouped matmul bf16 {shape[0]} x {shape[1]}x{shape[2]}x{shape[3]}",
                lambda s=shape: measure_grouped(s, "bf16", 1, budget),
            )
        )
    steps.append(
        ("attention grid", lambda: list(measure_attention_grid("cuda", 1, budget, quick, "bf16")))
    )
    for m in models:
        steps.append(
            (
                f"attention {m.name}",
                lambda m=m: list(measure_attention(m, plan, ranks, 1, budget, quick, "bf16")),
            )
        )
    steps.append(("bandwidth", lambda: measure_bandwidth(model, plan, 1, budget)))
    steps.append(("overhead", lambda: [measure_launch_overhead(model, moe, budget)]))
    return steps


def measure_launch_overhead(model: ModelSpec, moe: ModelSpec, budget: Budget) -> Overhead:
    """A GPU's fixed seconds of a dense and a MoE layer (`per_layer_s` on tiny models: kernel
    launches and the host's dispatch); the parallel extras are not measured there (0)."""
    dense = tiny_like(replace(model, experts=0, top_k=0, shared_experts=0, dense_layers=0), 1)
    torch.manual_seed(0)
    plain = per_layer_s(Transformer, dense, budget)
    moe_s = per_layer_s(Transformer, tiny_like(moe, 1), budget) if moe.is_moe else plain
    return Overhead(1, *plain, *moe_s, *([0.0] * 10))


def cuda_bf16_support() -> str:
    """ "native" when the GPU computes bf16 in hardware (Ampere and later), else "emulated"."""
    from fivefold.parallel.device import real_bf16

    return "native" if real_bf16() else "emulated"


def sort_rows(rows: list) -> ComputeTables:
    return ComputeTables(
        [r for r in rows if isinstance(r, Matmul)],
        [r for r in rows if isinstance(r, GroupedMatmul)],
        [r for r in rows if isinstance(r, Attention)],
        [r for r in rows if isinstance(r, Bandwidth)],
        [r for r in rows if isinstance(r, Overhead)],
    )


def build_profile(
    model: ModelSpec,
    ranks: int,
    bf16: str,
    tables: ComputeTables,
    backend: str,
    samples: list,
    collectives: list,
    device_name: str | None = None,
) -> DeviceProfile:
    """The profile of this machine from the measurements: of the GPU measured on (its name and
    memory) when kernels ran on CUDA, else of the CPU (host memory)."""
    cuda = _device.type == "cuda"
    memory = torch.cuda.get_device_properties(_device).total_memory if cuda else host_memory_bytes()
    return DeviceProfile(
        name=device_name or measured_device_name(),
        kind=_device.type,
        cores=available_cores(),
        memory_bytes=memory,
        backend=backend if backend != "none" else ("nccl" if cuda else "gloo"),
        ranks=max(1, ranks),
        bf16=bf16,
        model=model.name,
        torch=torch.__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        matmul=tuple(tables.matmul),
        grouped_matmul=tuple(tables.grouped_matmul),
        attention=tuple(tables.attention),
        bandwidth=tuple(tables.bandwidth),
        overhead=tuple(tables.overhead),
        collective=tuple(collectives),
        collective_sample=tuple(samples),
    )
