"""GEMMs and grouped expert GEMMs: the model's shapes, the device grid, and their measurement."""

from __future__ import annotations

import torch

from fivefold.calibration.timing import (
    TORCH_DTYPES,
    Budget,
    gemm_caches_cold,
    measured_device,
    randn_on_device,
    typical_time_s,
)
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.profile import (
    LAYOUTS,
    GroupedMatmul,
    Matmul,
)


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
# interpolates in log space). A CPU's sides stop where one GEMM takes about a second; the quick
# grid starts at 64, below a small MoE's rows per expert (128 at 512 tokens, 8 experts, top-2).
DEVICE_GRID = {
    ("cpu", False): ((128, 512, 2048), (128, 512, 2048)),
    ("cpu", True): ((64, 256, 2048), (64, 256, 2048)),
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
        a, b = randn_on_device(gen, m, k), randn_on_device(gen, n, k)
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b.t())
    if layout == "nn":  # input gradient: g [m, k] @ W [k, n]
        a, b = randn_on_device(gen, m, k), randn_on_device(gen, k, n)
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b)
    a, b = randn_on_device(gen, k, m), randn_on_device(gen, k, n)  # g^T x
    a, b = a.to(dtype), b.to(dtype)
    return lambda: torch.mm(a.t(), b)


def _fp8_operands(m: int, n: int, k: int, layout: str):
    """An FP8 (e4m3) matmul as torchao's float8 training runs pass `layout`: `_scaled_mm` of a
    row-major [m, k] by a column-major [k, n] operand, tensor-wise scales, bf16 output, with fast
    (lower-precision) accumulation in the forward ("nt": `Float8LinearConfig`'s
    `gemm_config_output`) and without it in the two gradient passes (its defaults there)."""
    device = measured_device()
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    fast = layout == "nt"
    return lambda: torch._scaled_mm(
        a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def fp8_supported() -> bool:
    """FP8 matmuls run natively: a CUDA device of compute capability 8.9 or later (Ada,
    Hopper, Blackwell) and torch's `_scaled_mm`."""
    return (
        measured_device().type == "cuda"
        and torch.cuda.get_device_capability(measured_device()) >= (8, 9)
        and hasattr(torch, "_scaled_mm")
        and hasattr(torch, "float8_e4m3fn")
    )


def measure_matmul(shape: tuple, dtype: str, threads: int, budget: Budget) -> Matmul:
    """One GEMM pass: (m, n, k) in `layout`'s operand layout (fp8: `_fp8_operands`, whose
    three passes share one kernel layout and differ in accumulation)."""
    m, n, k, layout = shape
    fn = (
        _fp8_operands(m, n, k, layout)
        if dtype == "fp8"
        else _operands(m, n, k, layout, TORCH_DTYPES[dtype])
    )
    seconds = typical_time_s(fn, budget, gemm_caches_cold())
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
    offs = torch.arange(1, groups + 1, dtype=torch.int32, device=measured_device()) * rows
    x = randn_on_device(gen, rows * groups, k).to(dtype)
    g = randn_on_device(gen, rows * groups, n).to(dtype)
    w = randn_on_device(gen, groups, n, k).to(dtype)
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
        seconds = typical_time_s(fn, budget, gemm_caches_cold())
        flops = 2.0 * rows * n * k
        out.append(GroupedMatmul(dtype, threads, groups, rows, n, k, layout, flops / seconds))
    return out
