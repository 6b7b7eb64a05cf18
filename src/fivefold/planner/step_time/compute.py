"""Compute time: FLOPs and bytes per micro-batch per rank, turned into seconds.

Everything is per rank and per micro-batch of b sequences; a rank holds T = b * s / cp tokens of
each sequence (context parallelism splits the sequence) and 1/tp of each matrix.

The efficiency model (parameters in `fivefold.planner.rates.efficiency`, fitted by
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
  plus the passes over the s^2 scores, all on their roofline with the scores streamed at
  `stream_fraction` of HBM bandwidth (`classic_attention`).
- Element-wise kernels are bound by HBM bandwidth at `hbm_fraction`. Per token per layer, forward:
  two RMSNorms (read and write h each), two residual adds (read 2h, write h), RoPE on q and k
  (read and write), the MLP activation (SwiGLU: read 2f, write f; GeLU: read f, write f), with
  dropout a one-byte mask per residual. The backward moves twice the forward's bytes. The
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
  `fivefold.specs.flops.early_stop_skipped_flops_per_token`); "selective" repeats only the
  attention core (Korthikanti et al. 2022).

Every rate comes from the device's `DeviceRates` (`planner.rates.device.rates_for`): the above
for a catalogued GPU (`CatalogRates`). A device measured by `fivefold calibrate`
(`MeasuredRates`, `fivefold.specs.profile`) replaces the efficiency model by its measurements:
every matmul as eager code runs it (wq, wk, wv separately; a MoE layer's routed experts as the
model's three `torch._grouped_mm` calls, `layer_matmuls.expert_projections`, from the measured
grouped table) is timed from the measured GEMM table, each pass on its own shape and operand
layout (forward x W^T on (m, n, k), input gradient g W on (m, k, n), weight gradient g^T x on
(n, k, m); the exact shape when measured, else interpolated in log space); the attention core
from its measured forward and backward rates; the element-wise bytes below, the loss and the
optimizer from bandwidths measured in the same byte accounting (so the unfused-traffic factor is
already in them: the attention kernel and fusion options do not apply); and the fixed cost of a
layer from the profile's measured forward and backward values for its kind (dense or MoE, plus
tensor and expert parallelism's extra and that of the data-parallel units the runtime wraps it
in for the plan's ZeRO level, `MeasuredRates.layer_overhead_s`).

Written by hand: PyTorch's FLOP counters need the model and a device; the planner needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.planner.memory.levers import state_recipe
from fivefold.planner.memory.model_states import local_kv_width
from fivefold.planner.rates.device import rates_for
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.step_time.layer_matmuls import alternate_matmuls, last_matmul
from fivefold.specs.flops import attention_flops_all_layers
from fivefold.specs.geometry import rank_tokens
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe

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


def classic_score_bytes(e: int, dropout: bool) -> tuple[float, float]:
    """(forward, backward) bytes per score of classic attention beyond its GEMMs, scores of `e`
    bytes: the softmax reads and writes them (2e), its backward reads the probabilities and
    their gradient and writes the scores' gradient (3e); dropout reads, writes and keeps a
    one-byte mask forward, reads the gradient and the mask and writes backward (2e + 1 each)."""
    extra = 2 * e + 1 if dropout else 0
    return 2 * e + extra, 3 * e + extra


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
    """Seconds for one (m x k) @ (k x n) matmul on `device` (`DeviceRates.gemm_s`); `layout`
    ("nt", "nn", "tn": which operand is transposed) matters on a measured device only."""
    return rates_for(device, eff).gemm_s(m, n, k, dtype, layout)


def memory_time_s(
    size_bytes: float, device: GPUSpec, eff: EfficiencyModel, kind: str = "elementwise_forward"
) -> float:
    """Seconds to stream `size_bytes` through HBM in element-wise kernels; a measured device
    uses its bandwidth of that `kind` (`fivefold.specs.profile.BANDWIDTH_KINDS`)."""
    return size_bytes / rates_for(device, eff).stream_bytes_per_s(kind)


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
    (`fivefold.specs.flops.causal_pairs_per_sequence`: s^2/2 pairs per sequence with one
    document, fewer with `model.doc_len`), split evenly over cp ranks."""
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
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
    blocks = plan.cp if plan.cp_kind in ("ring", "allgather") else 1  # block kernels
    forward, backward = rates_for(device, eff).attention_s(
        flops,
        attention_span(model, plan),
        model.head_dim,
        recipe(plan.precision).compute_dtype,
        blocks,
        plan.micro_batch * model.heads / plan.tp,
    )
    return (
        max(forward, memory_time_s(fwd_bytes, device, eff)),
        max(backward, memory_time_s(bwd_bytes, device, eff, "elementwise_backward")),
    )


def attention_bytes(model: ModelSpec, plan: ParallelPlan) -> tuple[float, float]:
    """(forward, backward) bytes a fused attention core moves at least, per layer and
    micro-batch on one rank: forward reads q, k, v and writes the output; backward reads q, k,
    v, the output and its gradient and writes the gradients of q, k and v."""
    e = recipe(plan.precision).activation_bytes
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    q, kv = model.q_width / plan.tp, local_kv_width(model, plan.tp)
    return tokens * e * (2 * q + 2 * kv), tokens * e * (4 * q + 4 * kv)


# ---- one transformer layer --------------------------------------------------------------------
def layer_elementwise_bytes(
    model: ModelSpec, plan: ParallelPlan, moe: bool, opts: ComputeOptions
) -> float:
    """HBM bytes of one layer's forward element-wise kernels on one rank (see module doc)."""
    e = recipe(plan.precision).activation_bytes
    t = plan.tp
    h = model.hidden
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
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
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
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
    """(forward, backward) seconds of unfused attention (Megatron 2021), on its roofline: QK^T
    and AV as batched GEMMs over the full scores (s/cp queries by all s keys: under context
    parallelism a rank's queries still meet every key), each the longer of its FLOPs at the
    large-GEMM fraction of peak and its bytes (the s^2 scores written or read) streamed; the
    fused scale-mask-softmax and dropout passes streamed, `classic_score_bytes` per score. The
    backward runs four such GEMMs for the forward's two. These long contiguous passes stream
    at `stream_fraction` of HBM bandwidth, not at the short element-wise kernels'
    `hbm_fraction` (a catalog GPU's figures: a measured device runs flash-type attention)."""
    q, s = model.seq_len / plan.cp, model.seq_len  # a rank's queries see every key (CP)
    batch = plan.micro_batch * model.heads / plan.tp
    d = model.head_dim
    e = recipe(plan.precision).activation_bytes
    flops_per_s = device.peak(recipe(plan.precision).compute_dtype) * eff.gemm_fraction(device.arch)
    bytes_per_s = device.hbm_bw_bytes_per_s * eff.stream_fraction
    # QK^T (q x d) @ (d x s) and AV (q x s) @ (s x d): 2 q s d FLOPs, e (q d + s d + q s) bytes
    one = max(2 * q * s * d / flops_per_s, e * (q * d + s * d + q * s) / bytes_per_s)
    gemm = batch * 2 * one
    fwd_bytes, bwd_bytes = classic_score_bytes(e, opts.dropout)
    scores = batch * q * s
    return gemm + scores * fwd_bytes / bytes_per_s, 2 * gemm + scores * bwd_bytes / bytes_per_s


def layer_work(
    model: ModelSpec,
    plan: ParallelPlan,
    device: GPUSpec,
    eff: EfficiencyModel,
    moe: bool = False,
    opts: ComputeOptions | None = None,
) -> Work:
    """Compute seconds of one transformer layer for one micro-batch on one rank."""
    rates = rates_for(device, eff)
    opts = rates.kernel_options(opts or ComputeOptions())
    dtype = recipe(plan.precision).compute_dtype
    gemm_f, gemm_b, gemm_w = rates.layer_matmuls_s(model, plan, moe)
    if opts.attention_kernel == "classic":
        attn_f, attn_b = classic_attention(model, plan, device, eff, opts)
    else:
        attn_f, attn_b = attention_times_s(model, plan, device, eff)
    elem_bytes = layer_elementwise_bytes(model, plan, moe, opts)
    if not opts.fused_elementwise:
        elem_bytes *= UNFUSED_TRAFFIC_FACTOR
    elem_flops = layer_elementwise_flops(model, plan, moe)
    elem_f = roofline_s(elem_flops, elem_bytes, device, eff, "elementwise_forward")
    elem_b = roofline_s(2 * elem_flops, 2 * elem_bytes, device, eff, "elementwise_backward")
    units = 2 if moe and plan.ep > 1 else 1  # the runtime wraps EP experts apart
    over_f, over_b = rates.layer_overhead_s(moe, plan.tp > 1, plan.zero, units, plan.ep > 1)
    forward = gemm_f + attn_f + elem_f + over_f
    if plan.recompute == "full":
        recompute = forward - _early_stop_s(model, plan, device, eff, moe, opts)
    elif plan.recompute == "selective" and opts.selective_policy == "alternate-matmul":
        alternate = alternate_matmuls(model, plan, moe)
        recompute = sum(c * rates.gemm_s(m, n, k, dtype) for m, n, k, c in alternate) + elem_f
    elif plan.recompute == "selective":
        recompute = attn_f
    else:
        recompute = 0.0
    backward_input = gemm_b + attn_b + elem_b + over_b + recompute
    return Work(forward, backward_input, gemm_w, recompute, gemm_f, attn_f, attn_b)


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
    return gemm_time_s(*last_matmul(model, plan, moe), device, eff, dtype)


def head_work(model: ModelSpec, plan: ParallelPlan, device: GPUSpec, eff: EfficiencyModel) -> Work:
    """The final norm, the LM head matmul and the cross-entropy loss for one micro-batch on the
    last stage; the loss and the norm on their rooflines (`roofline_s`)."""
    dtype = recipe(plan.precision).compute_dtype
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    v, h = model.vocab / plan.tp, model.hidden
    gemm, gemm_b, gemm_w = rates_for(device, eff).gemm_passes_s(tokens, v, h, dtype)
    logits = tokens * v
    logit_bytes = logits * LOSS_BYTES_PER_LOGIT
    fwd_flops, bwd_flops = logits * LOSS_FORWARD_FLOPS, logits * LOSS_BACKWARD_FLOPS
    fwd_bytes = logit_bytes * 10 / LOSS_BYTES_PER_LOGIT
    bwd_bytes = logit_bytes * 14 / LOSS_BYTES_PER_LOGIT
    fwd_loss = roofline_s(fwd_flops, fwd_bytes, device, eff, "loss_forward")
    bwd_loss = roofline_s(bwd_flops, bwd_bytes, device, eff, "loss_backward")
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
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
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
    `plan.optimizer_states`, `fivefold.planner.memory.levers`), reads the gradient, writes the
    parameter."""
    rec = state_recipe(plan)
    return 2 * rec.optimizer_bytes + rec.grad_bytes + rec.param_bytes + CLIP_PASSES * rec.grad_bytes
