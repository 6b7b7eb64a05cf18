"""Compute time: FLOPs and bytes per micro-batch per rank, turned into seconds.

Everything is per rank and per micro-batch of b sequences; a rank holds T = b * s / cp tokens of
each sequence (context parallelism splits the sequence) and 1/tp of each matrix.

The efficiency model (parameters in `fivefold.planner.calibration`, fitted by
`scripts/calibrate.py`):

- GEMMs. A matmul of (m x k) by (k x n) does 2mnk FLOPs and moves e(mk + kn + mn) bytes, an
  arithmetic intensity I = 2mnk / (e(mk + kn + mn)) FLOP/byte. It runs at
      peak * min(gemm_peak_fraction[arch] * I / (I + gemm_half_intensity * ridge), I / ridge),
  ridge = peak / HBM bandwidth: a smooth roofline under the hard one. Large square GEMMs
  approach the architecture's fraction; thin ones (small h/tp, few tokens per expert) are
  bandwidth-bound. The backward runs two GEMMs of the same size per forward GEMM: the input
  gradient (in the "B" pass) and the weight gradient (the "W" pass).
- Attention core. Fused (flash) kernels: 4 * pairs * head_dim * heads/tp causal FLOPs forward,
  pairs = b/cp * s^2/2 with one document per sequence, or per document with the training data's
  document length (`model.doc_len`, `causal_pairs_per_sequence`), at `attention_peak_fraction`
  of peak, the backward `attention_backward_ratio` (2.5) times the forward time. Classic
  kernels (Megatron 2021: QK^T and AV as batched GEMMs over the full s x s matrix, then a
  fused scale-mask-softmax and dropout in HBM) are two batched GEMMs of shape (s, s, head_dim)
  plus the element-wise passes over the s^2 scores.
- Element-wise kernels are bound by HBM bandwidth at `hbm_fraction`. Per token per layer, forward:
  two RMSNorms (read and write h each), two residual adds (read 2h, write h), RoPE on q and k
  (read and write), the MLP activation (SwiGLU: read 2f, write f; GeLU: read f, write f), with
  dropout a one-byte mask per residual; the scores of classic attention cost 4 bytes per element
  (softmax read and write) plus 5 with dropout. The backward moves twice the forward's bytes. The
  norms and residuals run on T/tp tokens with sequence parallelism, on all T without (replicated
  over the TP group); the loss reads and writes 24 bytes per fp32 logit (forward and backward).
- The roofline under every memory-side op (`roofline_s`): the element-wise kernels, the
  attention core (its minimum traffic, `attention_bytes`), the final norm and the loss, the
  embedding (`embedding_work`) and the optimizer step with gradient clipping each take the
  larger of their FLOPs at the vector (fp32) rate and their bytes at the achievable bandwidth.
- A fixed `layer_overhead_s` per layer forward (twice in the backward): kernel launches and
  tails.
- Recompute: "full" repeats the layer's forward inside the backward (less the block's last
  matmul with `checkpoint_early_stop`, what torch's non-reentrant checkpoint skips; see
  `fivefold.spec.flops.early_stop_skipped_flops_per_token`); "selective" repeats only the
  attention core (Korthikanti et al. 2022).

A device measured by `fivefold calibrate` (`device.measured`, `fivefold.spec.profile`) replaces
the efficiency model by its measurements: every matmul as eager code runs it (wq, wk, wv
separately; a MoE layer's routed experts as the model's three `torch._grouped_mm` calls,
`expert_projections`, from the measured grouped table) is timed from the measured GEMM table,
each pass on its own shape and operand layout (forward x W^T on (m, n, k), input gradient g W
on (m, k, n), weight gradient g^T x on (n, k, m);
the exact shape when measured, else interpolated by arithmetic intensity); the attention core
from its measured forward and backward rates; the element-wise bytes below, the loss and the
optimizer from bandwidths measured in the same byte accounting (so the unfused-traffic factor
is already in them); and the fixed cost of a layer from the profile's measured forward and
backward values for its kind (dense or MoE, plus tensor and expert parallelism's extra and
that of the data-parallel units the runtime wraps it in for the plan's ZeRO level,
`Measured.layer_overhead_s`).

Written by hand: PyTorch's FLOP counters need the model and a device; the planner needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.planner.calibration import EfficiencyModel
from fivefold.planner.levers import state_recipe
from fivefold.planner.memory import local_kv_width
from fivefold.spec.flops import attention_flops_all_layers
from fivefold.spec.hardware import GPUSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import recipe

ATTENTION_DTYPE = "bf16"  # attention kernels run in bf16 even under fp8 recipes
LOSS_BYTES_PER_LOGIT = 24.0  # fp32: upcast, log-softmax, gradient, cast back


# FLOPs per element of the memory-side kernels: the compute side of their roofline, on the
# device's vector (non-tensor-core) fp32 rate. Norm: square, sum, scale, weight; residual add: 1;
# RoPE: two multiplies and an add; SwiGLU: SiLU (negate, exp, add, divide) and the product;
# GeLU (tanh form): about 8; the loss per logit: max, subtract, exp, sum, log, pick forward;
# exp back to the softmax, minus one-hot, scale backward; AdamW: 2 moments, bias corrections,
# the update and weight decay; clipping: square-and-sum, then scale.
NORM_FLOPS, ADD_FLOPS, ROPE_FLOPS = 4.0, 1.0, 3.0
ACTIVATION_FLOPS = {"swiglu": 5.0, "gelu": 8.0}
LOSS_FORWARD_FLOPS, LOSS_BACKWARD_FLOPS = 6.0, 4.0  # per logit
ADAMW_FLOPS_PER_PARAM, CLIP_FLOPS_PER_PARAM = 12.0, 3.0
CLIP_PASSES = 3  # gradient clipping reads every gradient for the norm, then reads and writes it

# Eager PyTorch's unfused kernels move about 3x the bytes of fused ones, counted for a Llama
# block: RMSNorm as 7 fp32 passes (upcast, pow, mean, rsqrt, mul, cast, weight) against 2 bf16
# ones; RoPE through complex fp32 (5 passes against 2); SiLU then multiply (10 bytes per element
# against 6).
UNFUSED_TRAFFIC_FACTOR = 3.0
SELECTIVE_POLICIES = ("attention", "alternate-matmul")


@dataclass(frozen=True)
class ComputeOptions:
    attention_kernel: str = "flash"  # or "classic"
    dropout: bool = False
    fused_elementwise: bool = True
    selective_policy: str = "attention"  # or "alternate-matmul"
    checkpoint_early_stop: bool = False  # full recompute skips each block's last matmul


@dataclass(frozen=True)
class Work:
    """Seconds of compute on one rank for one micro-batch, by pass.

    `backward_input_s` includes recomputation (`recompute_s` says how much of it); `gemm_*` are the
    GEMM parts, which tensor-parallel communication can hide behind.
    """

    forward_s: float = 0.0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    recompute_s: float = 0.0
    gemm_forward_s: float = 0.0
    attention_forward_s: float = 0.0
    attention_backward_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_input_s + self.backward_weight_s

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(_fields(self), _fields(other), strict=True)))

    def scaled(self, k: float) -> Work:
        return Work(*(a * k for a in _fields(self)))


def _fields(w: Work) -> tuple[float, ...]:
    return (
        w.forward_s,
        w.backward_input_s,
        w.backward_weight_s,
        w.recompute_s,
        w.gemm_forward_s,
        w.attention_forward_s,
        w.attention_backward_s,
    )


# ---- back-of-envelope helpers (the seeds' arithmetic) -------------------------------------------
SECONDS_PER_YEAR = 365.25 * 86400


def training_flops(n_params: float, tokens: float) -> float:
    """The 6 N D rule: forward (2N) plus backward (4N) FLOPs per token, times D tokens."""
    return 6.0 * n_params * tokens


def time_to_train_s(flops: float, gpus: int, peak_flops: float, mfu: float = 1.0) -> float:
    """Seconds to do `flops` on `gpus` devices of `peak_flops` each at utilisation `mfu`."""
    return flops / (gpus * peak_flops * mfu)


def gemm_intensity(
    m: float, n: float, k: float, element_bytes: float = 2, include_output: bool = True
) -> float:
    """FLOP per byte of an (m x k) @ (k x n) matmul: 2mnk over the bytes of its operands (and
    of its output unless `include_output` is False)."""
    moved = m * k + k * n + (m * n if include_output else 0)
    return 2.0 * m * n * k / (element_bytes * moved)


def ridge_point(device: GPUSpec, dtype: str = "bf16") -> float:
    """FLOP per byte where the roofline turns: peak FLOP/s over HBM bytes/s."""
    return device.peak(dtype) / device.hbm_bw_bytes_per_s


# ---- kernels ----------------------------------------------------------------------------------
def gemm_time_s(
    m: float,
    n: float,
    k: float,
    device: GPUSpec,
    eff: EfficiencyModel,
    dtype: str = "bf16",
    layout: str = "nt",
) -> float:
    """Seconds for one (m x k) @ (k x n) matmul on `device` (see the module docstring);
    `layout` ("nt", "nn", "tn": which operand is transposed) matters on a measured device only."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    if device.measured is not None:
        return 2.0 * m * n * k / device.measured.gemm_flops_per_s(m, n, k, dtype, layout)
    e = {"fp8": 1, "bf16": 2, "fp16": 2}.get(dtype, 4)
    flops = 2.0 * m * n * k
    intensity = flops / (e * (m * k + k * n + m * n))
    peak = device.peak(dtype)
    ridge = peak / device.hbm_bw_bytes_per_s
    fraction = eff.gemm_fraction(device.arch) * intensity
    fraction /= intensity + eff.gemm_half_intensity * ridge
    fraction = min(fraction, intensity / ridge)  # never above the roofline
    return flops / (peak * fraction)


def memory_time_s(
    size_bytes: float, device: GPUSpec, eff: EfficiencyModel, kind: str = "elementwise_forward"
) -> float:
    """Seconds to stream `size_bytes` through HBM in element-wise kernels; a measured device
    uses its bandwidth of that `kind` (`fivefold.spec.profile.BANDWIDTH_KINDS`)."""
    if device.measured is not None:
        return size_bytes / device.measured.bandwidth(kind)
    return size_bytes / (device.hbm_bw_bytes_per_s * eff.hbm_fraction)


def vector_flops_per_s(device: GPUSpec) -> float:
    """FLOP/s of element-wise arithmetic: the fp32 figure (CUDA cores on a catalog GPU; the
    best measured fp32 matmul rate, an upper bound, on a measured device); 0 when unknown."""
    return device.peak_flops.get("fp32", 0.0)


def roofline_s(
    flops: float,
    size_bytes: float,
    device: GPUSpec,
    eff: EfficiencyModel,
    kind: str = "elementwise_forward",
) -> float:
    """Seconds of one memory-side kernel under the roofline: the larger of its FLOPs at the
    vector rate and its bytes at the achievable bandwidth of `kind` (`memory_time_s`)."""
    rate = vector_flops_per_s(device)
    compute = flops / rate if rate > 0 else 0.0
    return max(compute, memory_time_s(size_bytes, device, eff, kind))


def attention_flops(model: ModelSpec, plan: ParallelPlan) -> float:
    """Causal forward FLOPs of one layer's attention core for one micro-batch on one rank (the
    layers' mean where some attend in a sliding window), per document
    (`fivefold.spec.flops.causal_pairs_per_sequence`: s^2/2 pairs per sequence with one
    document, fewer with `model.doc_len`), split evenly over cp ranks."""
    tokens = plan.micro_batch * model.seq_len / plan.cp
    per_layer = attention_flops_all_layers(model, model.seq_len) / model.layers
    return tokens * per_layer / plan.tp


def attention_span(model: ModelSpec, plan: ParallelPlan) -> float:
    """Tokens one attention kernel call spans on a rank: the local sequence s/cp, or a
    document when `model.doc_len` is shorter (the rate a measured device is read at)."""
    local = model.seq_len / plan.cp
    return min(local, model.doc_len) if model.doc_len > 0 else local


def flash_attention_forward_s(
    model: ModelSpec, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel
) -> float:
    return attention_times_s(model, plan, device, eff)[0]


def attention_times_s(
    model: ModelSpec, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel
) -> tuple[float, float]:
    """(forward, backward) seconds of the fused attention core: the efficiency model's fraction
    of the bf16 peak and backward ratio, or a measured device's rates (backward: 2x the FLOPs);
    under ring or all-gather context parallelism the rates measured for the runtime's block
    kernels at that cp (smaller blocks, their log-sum-exp merges and Python per block)."""
    flops = attention_flops(model, plan)
    fwd_bytes, bwd_bytes = attention_bytes(model, plan)
    if device.measured is not None:
        dtype = recipe(plan.precision).compute_dtype
        blocks = plan.cp if plan.cp_kind in ("ring", "allgather") else 1  # block kernels
        fwd, bwd = device.measured.attention_flops_per_s(
            attention_span(model, plan),
            model.head_dim,
            dtype,
            blocks,
            plan.micro_batch * model.heads / plan.tp,
        )
        forward, backward = flops / fwd, 2.0 * flops / bwd
    else:
        forward = flops / (device.peak(ATTENTION_DTYPE) * eff.attention_peak_fraction)
        backward = eff.attention_backward_ratio * forward
    return (
        max(forward, memory_time_s(fwd_bytes, device, eff)),
        max(backward, memory_time_s(bwd_bytes, device, eff, "elementwise_backward")),
    )


def attention_bytes(model: ModelSpec, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) bytes a fused attention core moves at least, per layer and
    micro-batch on one rank: forward reads q, k, v and writes the output; backward reads q, k,
    v, the output and its gradient and writes the gradients of q, k and v."""
    e = recipe(plan.precision).activation_bytes
    tokens = plan.micro_batch * model.seq_len / plan.cp
    q, kv = model.q_width / plan.tp, local_kv_width(model, plan.tp)
    return tokens * e * (2 * q + 2 * kv), tokens * e * (4 * q + 4 * kv)


# ---- one transformer layer --------------------------------------------------------------------
def attention_gemms(
    model: ModelSpec, tokens: float, t: int
) -> list[tuple[float, float, float, float]]:
    """Forward attention-projection GEMMs of one layer on one TP rank as (m, n, k, count): the
    fused QKV and O; with MLA (`ModelSpec.attention_matrices`) the key/value latent and query
    down projections replicated, the per-head up projections and O split by heads."""
    h = model.hidden
    if not model.is_mla:
        q, kv = model.q_width / t, local_kv_width(model, t)
        return [(tokens, q + 2 * kv, h, 1.0), (tokens, h, q, 1.0)]
    heads = model.heads / t
    nope = model.head_dim - model.qk_rope_head_dim
    out = [
        (tokens, model.kv_lora_rank + model.qk_rope_head_dim, h, 1.0),
        (tokens, heads * (nope + model.value_dim), model.kv_lora_rank, 1.0),
    ]
    rank = model.q_lora_rank
    if rank:
        out += [(tokens, rank, h, 1.0), (tokens, heads * model.head_dim, rank, 1.0)]
    else:
        out.append((tokens, heads * model.head_dim, h, 1.0))
    return [*out, (tokens, h, heads * model.value_dim, 1.0)]


def layer_gemms(
    model: ModelSpec, plan: ParallelPlan, moe: bool
) -> list[tuple[float, float, float, float]]:
    """Forward GEMMs of one layer on one rank as (m, n, k, count)."""
    t = plan.tp
    h = model.hidden
    tokens = plan.micro_batch * model.seq_len / plan.cp
    out = attention_gemms(model, tokens, t)
    if not moe:
        f = model.ffn / t
        up = 2 * f if model.mlp == "swiglu" else f
        return [*out, (tokens, up, h, 1.0), (tokens, h, f, 1.0)]
    fe = model.expert_ffn / t
    local_experts = model.experts / plan.ep
    per_expert = tokens * model.top_k * plan.ep / model.experts
    out += [(tokens, model.experts, h, 1.0)]  # router (replicated over TP)
    out += [(per_expert, 2 * fe, h, local_experts), (per_expert, h, fe, local_experts)]
    if model.shared_experts:
        width = model.shared_experts * fe
        out += [(tokens, 2 * width, h, 1.0), (tokens, h, width, 1.0)]
    return out


def layer_elementwise_bytes(
    model: ModelSpec, plan: ParallelPlan, moe: bool, opts: ComputeOptions
) -> float:
    """HBM bytes of one layer's forward element-wise kernels on one rank (see module doc)."""
    e = recipe(plan.precision).activation_bytes
    t = plan.tp
    h = model.hidden
    tokens = plan.micro_batch * model.seq_len / plan.cp
    region_tokens = tokens / t if plan.sp and t > 1 else tokens
    per_region_token = 2 * 2 * e * h + 2 * 3 * e * h  # two norms + two residual adds
    if opts.dropout:
        per_region_token += 2 * h  # one-byte masks
    total = region_tokens * per_region_token
    total += tokens * 2 * e * (model.q_width / t + local_kv_width(model, t))  # RoPE on q, k
    if not moe:
        f = model.ffn / t
        total += tokens * (3 if model.mlp == "swiglu" else 2) * e * f
    else:
        fe = model.expert_ffn / t
        total += tokens * model.top_k * 3 * e * fe  # expert SwiGLU
        total += tokens * model.top_k * 2 * 2 * e * h  # permute and un-permute the copies
        total += tokens * model.shared_experts * 3 * e * fe
    return total


def layer_elementwise_flops(model: ModelSpec, plan: ParallelPlan, moe: bool) -> float:
    """Vector FLOPs of one layer's forward element-wise kernels on one rank (the compute side of
    their roofline; the same kernels as `layer_elementwise_bytes`)."""
    t, h = plan.tp, model.hidden
    tokens = plan.micro_batch * model.seq_len / plan.cp
    region_tokens = tokens / t if plan.sp and t > 1 else tokens
    total = region_tokens * h * (2 * NORM_FLOPS + 2 * ADD_FLOPS)
    total += tokens * ROPE_FLOPS * (model.q_width / t + local_kv_width(model, t))
    act = ACTIVATION_FLOPS.get(model.mlp, ACTIVATION_FLOPS["gelu"])
    if not moe:
        return total + tokens * act * model.ffn / t
    fe = model.expert_ffn / t
    return total + tokens * act * fe * (model.top_k + model.shared_experts)


def classic_attention(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    opts: ComputeOptions,
) -> tuple[float, float]:
    """(forward, backward) seconds of unfused attention: batched GEMMs over the full s x s
    scores plus the softmax (and dropout) passes over them in HBM."""
    s = model.seq_len / plan.cp
    batch = plan.micro_batch * model.heads / plan.tp
    d = model.head_dim
    gemm = batch * (gemm_time_s(s, s, d, device, eff) + gemm_time_s(s, d, s, device, eff))
    scores = batch * s * s
    bytes_per_score = 4.0 + (5.0 if opts.dropout else 0.0)
    elementwise = memory_time_s(scores * bytes_per_score, device, eff)
    return gemm + elementwise, 2 * gemm + 2 * elementwise


def layer_work(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    moe: bool = False,
    opts: ComputeOptions | None = None,
) -> Work:
    """Compute seconds of one transformer layer for one micro-batch on one rank."""
    opts = opts or ComputeOptions()
    dtype = recipe(plan.precision).compute_dtype
    if device.measured is not None:
        return _measured_layer_work(model, plan, device, eff, moe, opts)
    gemm = sum(
        count * gemm_time_s(m, n, k, device, eff, dtype)
        for m, n, k, count in layer_gemms(model, plan, moe)
    )
    if opts.attention_kernel == "classic":
        attn_f, attn_b = classic_attention(model, plan, device, eff, opts)
    else:
        attn_f, attn_b = attention_times_s(model, plan, device, eff)
    elem_bytes = layer_elementwise_bytes(model, plan, moe, opts)
    if not opts.fused_elementwise:
        elem_bytes *= UNFUSED_TRAFFIC_FACTOR
    elem = roofline_s(layer_elementwise_flops(model, plan, moe), elem_bytes, device, eff)
    overhead = eff.layer_overhead_s
    forward = gemm + attn_f + elem + overhead
    if plan.recompute == "full":
        recompute = forward - _early_stop_s(model, plan, device, eff, moe, opts)
    elif plan.recompute == "selective" and opts.selective_policy == "alternate-matmul":
        gemms = layer_gemms(model, plan, moe)
        recompute = (
            sum(
                count * gemm_time_s(m, n, k, device, eff, dtype)
                for m, n, k, count in _alternate(_split_fused(model, plan, gemms, moe))
            )
            + elem
        )
    elif plan.recompute == "selective":
        recompute = attn_f
    else:
        recompute = 0.0
    backward_input = gemm + attn_b + 2 * elem + 2 * overhead + recompute
    return Work(forward, backward_input, gemm, recompute, gemm, attn_f, attn_b)


def _last_matmul(model: ModelSpec, plan: ParallelPlan, moe: bool) -> tuple[float, float, float]:
    """(m, n, k) of the block's last matmul, the one checkpoint early stop skips (zero k: none)."""
    tokens = plan.micro_batch * model.seq_len / plan.cp
    width = model.shared_experts * model.expert_ffn if moe else model.ffn
    return tokens, model.hidden, width / plan.tp


def _early_stop_s(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    moe: bool,
    opts: ComputeOptions,
) -> float:
    """Forward seconds full recompute does not repeat under checkpoint early stop."""
    if not opts.checkpoint_early_stop:
        return 0.0
    dtype = recipe(plan.precision).compute_dtype
    return gemm_time_s(*_last_matmul(model, plan, moe), device, eff, dtype)


def _measured_layer_work(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    moe: bool,
    opts: ComputeOptions,
) -> Work:
    """`layer_work` on a measured device (module docstring): every matmul as eager code runs it,
    each backward pass on its own shape and layout, measured attention, bandwidths, overhead."""
    assert device.measured is not None
    dtype = recipe(plan.precision).compute_dtype
    gemms = _split_fused(model, plan, layer_gemms(model, plan, moe), moe)

    def passes(shapes: list) -> tuple[float, float, float]:
        fwd = sum(c * gemm_time_s(m, n, k, device, eff, dtype, "nt") for m, n, k, c in shapes)
        dgrad = sum(c * gemm_time_s(m, k, n, device, eff, dtype, "nn") for m, n, k, c in shapes)
        wgrad = sum(c * gemm_time_s(n, k, m, device, eff, dtype, "tn") for m, n, k, c in shapes)
        return fwd, dgrad, wgrad

    gemm_f, gemm_b, gemm_w = passes(gemms)
    if moe:
        grouped = device.measured.grouped_time_s
        for shape in expert_projections(model, plan):
            gemm_f += grouped(*shape, dtype, "nt")
            gemm_b += grouped(*shape, dtype, "nn")
            gemm_w += grouped(*shape, dtype, "tn")
    attn_f, attn_b = attention_times_s(model, plan, device, eff)
    elem_bytes = layer_elementwise_bytes(model, plan, moe, opts)
    elem_flops = layer_elementwise_flops(model, plan, moe)
    elem_f = roofline_s(elem_flops, elem_bytes, device, eff, "elementwise_forward")
    elem_b = roofline_s(2 * elem_flops, 2 * elem_bytes, device, eff, "elementwise_backward")
    units = 2 if moe and plan.ep > 1 else 1  # the runtime wraps EP experts apart
    over_f, over_b = device.measured.layer_overhead_s(
        moe, plan.tp > 1, plan.zero, units, plan.ep > 1
    )
    forward = gemm_f + attn_f + elem_f + over_f
    if plan.recompute == "full":
        recompute = forward - _early_stop_s(model, plan, device, eff, moe, opts)
    elif plan.recompute == "selective" and opts.selective_policy == "alternate-matmul":
        recompute = passes(_alternate(gemms))[0] + elem_f
    elif plan.recompute == "selective":
        recompute = attn_f
    else:
        recompute = 0.0
    backward_input = gemm_b + attn_b + elem_b + over_b + recompute
    return Work(forward, backward_input, gemm_w, recompute, gemm_f, attn_f, attn_b)


def _split_fused(model: ModelSpec, plan: ParallelPlan, gemms: list, moe: bool) -> list:
    """The per-matrix matmuls in execution order as eager code runs them (wq, wk, wv, wo, then
    w1, w3, w2 of a dense layer, or the router and the shared experts' w1, w3, w2 of a MoE
    layer); the routed experts are grouped matmuls apart (`expert_projections`)."""
    t = plan.tp
    tokens, h = gemms[0][0], model.hidden
    kv = local_kv_width(model, t)
    out = [
        (tokens, model.q_width / t, h, 1.0),
        (tokens, kv, h, 1.0),
        (tokens, kv, h, 1.0),
        gemms[1],
    ]
    if moe:
        out.append(gemms[2])  # the router
        width = model.shared_experts * model.expert_ffn / t
        if width:
            out += [(tokens, width, h, 1.0), (tokens, width, h, 1.0), (tokens, h, width, 1.0)]
        return out
    f = model.ffn / t
    if model.mlp == "swiglu":
        return [*out, (tokens, f, h, 1.0), (tokens, f, h, 1.0), gemms[3]]
    return [*out, gemms[2], gemms[3]]


def expert_projections(model: ModelSpec, plan: ParallelPlan) -> list[tuple[float, ...]]:
    """The routed experts' three grouped matmuls (w1, w3, w2) of one MoE layer on one rank as
    (groups, tokens, n, k): the rank's experts / ep groups share tokens x top_k rows (every
    rank's tokens routed to these experts, balanced), forward shape (rows x k) @ (k x n)."""
    groups = model.experts / plan.ep
    rows = plan.micro_batch * model.seq_len / plan.cp * model.top_k
    fe, h = model.expert_ffn / plan.tp, model.hidden
    return [(groups, rows, fe, h), (groups, rows, fe, h), (groups, rows, h, fe)]


def _alternate(gemms: list) -> list:
    """Every second matmul (the 2nd, 4th, ...): what op-level SAC recomputes."""
    return gemms[1::2]


def head_work(model: ModelSpec, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel) -> Work:
    """The final norm, the LM head matmul and the cross-entropy loss for one micro-batch on the
    last stage; the loss and the norm on their rooflines (`roofline_s`)."""
    dtype = recipe(plan.precision).compute_dtype
    tokens = plan.micro_batch * model.seq_len / plan.cp
    v, h = model.vocab / plan.tp, model.hidden
    gemm = gemm_time_s(tokens, v, h, device, eff, dtype)
    logits = tokens * v
    logit_bytes = logits * LOSS_BYTES_PER_LOGIT
    fwd_flops, bwd_flops = logits * LOSS_FORWARD_FLOPS, logits * LOSS_BACKWARD_FLOPS
    if device.measured is not None:  # measured loss forward and backward rates
        fwd_loss = roofline_s(fwd_flops, logit_bytes * 10 / 24, device, eff, "loss_forward")
        bwd_loss = roofline_s(bwd_flops, logit_bytes * 14 / 24, device, eff, "loss_backward")
        gemm_b = gemm_time_s(tokens, h, v, device, eff, dtype, "nn")
        gemm_w = gemm_time_s(v, h, tokens, device, eff, dtype, "tn")
    else:
        fwd_loss = roofline_s(fwd_flops, logit_bytes * 10 / LOSS_BYTES_PER_LOGIT, device, eff)
        bwd_loss = roofline_s(bwd_flops, logit_bytes * 14 / LOSS_BYTES_PER_LOGIT, device, eff)
        gemm_b = gemm_w = gemm
    norm_flops = tokens * h * NORM_FLOPS
    norm = roofline_s(norm_flops, tokens * h * 2 * 2, device, eff)
    norm_b = roofline_s(2 * norm_flops, 2 * tokens * h * 2 * 2, device, eff, "elementwise_backward")
    return Work(gemm + fwd_loss + norm, gemm_b + bwd_loss + norm_b, gemm_w, 0.0, gemm)


def embedding_work(
    model: ModelSpec, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel
) -> Work:
    """The token embedding on the first stage for one micro-batch: forward gathers a row per
    token (read and write T x h); backward writes a zeroed [vocab / tp, h] gradient and adds a
    row per token into it (memory-bound, `roofline_s`)."""
    rec = recipe(plan.precision)
    tokens = plan.micro_batch * model.seq_len / plan.cp
    h = model.hidden
    rows = tokens * h
    forward = roofline_s(0.0, 2 * rows * rec.activation_bytes, device, eff)
    table = model.vocab / plan.tp * h * rec.grad_bytes
    backward = roofline_s(
        rows, table + rows * (rec.activation_bytes + 2 * rec.grad_bytes), device, eff,
        "elementwise_backward",
    )  # fmt: skip
    return Work(forward, backward)


def optimizer_step_s(
    local_params: float, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel
) -> float:
    """Gradient clipping and AdamW over `local_params` parameters on their roofline: the bytes
    of `optimizer_bytes_per_param` at the optimizer bandwidth, or the FLOPs at the vector rate."""
    flops = local_params * (ADAMW_FLOPS_PER_PARAM + CLIP_FLOPS_PER_PARAM)
    size = local_params * optimizer_bytes_per_param(plan)
    return roofline_s(flops, size, device, eff, "optimizer")


def optimizer_bytes_per_param(plan: ParallelPlan) -> float:
    """Bytes the optimizer step moves per parameter: clipping reads every gradient for the norm
    and reads and writes it to scale it (`CLIP_PASSES`); Adam reads and writes its state (in
    `plan.optimizer_states`, `fivefold.planner.levers`), reads the gradient, writes the
    parameter."""
    rec = state_recipe(plan)
    return 2 * rec.optimizer_bytes + rec.grad_bytes + rec.param_bytes + CLIP_PASSES * rec.grad_bytes
