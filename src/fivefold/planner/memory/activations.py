"""Activation bytes one rank keeps for the backward, per layer and per virtual stage, for one
micro-batch: Korthikanti et al. 2022 (fused kernels), fivefold's eager and compiled blocks, the
recompute policies, and the simple k = 12 model of the distributed-training guides.

Derivations: docs/planner.md, section 3 ("Activations", "What fivefold's own runtime keeps").
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.planner.memory.model_states import chunk_layers, layer_params_per_rank, local_kv_width
from fivefold.planner.memory.options import COMPILED, EAGER, MemoryOptions
from fivefold.specs.float8 import fp8_linears, fp8_tensor_parallel
from fivefold.specs.geometry import moe_token_split, rank_tokens, sequence_shard_divisor
from fivefold.specs.model import ModelSpec
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.precision import recipe

SIMPLE_K = 12  # per-block multiplier of the simple model of the distributed-training guides


@dataclass(frozen=True)
class LayerTokens:
    """What one layer's activations on one rank depend on, for one micro-batch: `e` bytes per
    activation element, `sb` = b s/cp token rows, `rdiv` = tp under sequence parallelism (the
    norm region holds 1/tp of the rows) else 1, and the layer's recompute `policy`."""

    model: ModelSpec
    plan: ParallelPlan
    moe: bool
    policy: str
    e: float
    sb: float
    rdiv: int


def layer_tokens(
    model: ModelSpec, plan: ParallelPlan, moe: bool = False, policy: str | None = None
) -> LayerTokens:
    """The `LayerTokens` of `plan`'s layers (`policy` defaults to the plan's recompute)."""
    return LayerTokens(
        model=model,
        plan=plan,
        moe=moe,
        policy=policy or plan.recompute,
        e=recipe(plan.precision).activation_bytes,
        sb=rank_tokens(plan.micro_batch, model.seq_len, plan),
        rdiv=sequence_shard_divisor(plan.sp, plan),
    )


def layer_activation_bytes(
    model: ModelSpec,
    plan: ParallelPlan,
    moe: bool = False,
    options: MemoryOptions | None = None,
    recompute: str | None = None,
) -> float:
    """Bytes one layer keeps for the backward, per micro-batch, on one rank (docs/planner.md)."""
    opts = options or MemoryOptions()
    layer = layer_tokens(model, plan, moe, recompute)
    e, sb, h = layer.e, layer.sb, model.hidden
    if opts.activation_model == "simple":
        return SIMPLE_K * sb * h * e
    if layer.policy == "full":
        return e * sb * h / layer.rdiv
    if layer.policy == "selective" and opts.selective_policy == "alternate-matmul" and not moe:
        return _alternate_matmul_bytes(layer)
    if opts.eager:
        if opts.compiled:
            return _compiled_bytes(layer, opts)
        fp8_tp = 0.0 if moe else fp8_tensor_parallel_bytes(layer)
        return _eager_bytes(layer) - sp_regather_saving(layer) + fp8_tp
    return _stored_bytes(layer, opts)


def eager_norm_bytes(layer: LayerTokens) -> float:
    """One eager RMSNorm and the matmul after it: its input in the activation dtype (and any
    fp32 copies, `EagerProfile`) and the fp32 reciprocal RMS per token in the norm's region
    (/tp under SP), and the output the next matmul keeps, gathered to the full sequence under
    TP+SP."""
    e, sb, h = layer.e, layer.sb, layer.model.hidden
    return (eager_norm_kept(e) * sb * h + 4 * sb) / layer.rdiv + e * sb * h


def sp_regathered_inputs(model: ModelSpec, plan: ParallelPlan, moe: bool) -> int:
    """fivefold-eager under TP+SP (`fivefold.parallel.sp_regather`): how many of a layer's
    gathered inputs [b, s, h] (the attention's, the dense MLP's) are kept as their sequence
    shard [b, s/tp, h] and all-gathered again in the backward. None for an input torchao's
    float8 styles gather in FP8 (`fp8_tensor_parallel`), inside a fully recomputed block, or
    for a MoE layer's routed part (its input is the rank's own tokens, never gathered).
    Compiled blocks keep theirs gathered (`_compiled_bytes` does not count this)."""
    if not (plan.sp and plan.tp > 1) or plan.recompute == "full":
        return 0
    fp8 = fp8_tensor_parallel(model, plan.fp8, moe)
    return (not fp8.gathered_inputs[0]) + (not moe and not fp8.gathered_inputs[1])


def sp_regather_saving(layer: LayerTokens) -> float:
    """Bytes per layer `sp_regathered_inputs` saves of what `eager_norm_bytes` counts:
    (1 - 1/tp) e b s h per regathered input."""
    regathered = sp_regathered_inputs(layer.model, layer.plan, layer.moe)
    return regathered * layer.e * layer.sb * layer.model.hidden * (1 - 1 / layer.plan.tp)


def eager_norm_kept(e: float) -> float:
    """Bytes an eager RMSNorm keeps per element of its input (`EagerProfile`), besides its
    fp32 reciprocal RMS per row; `e` the activation dtype's bytes."""
    return EAGER.norm_fp32_saved * 4 + EAGER.norm_input_saved * e


def qk_norm_bytes(layer: LayerTokens, per_element: float) -> float:
    """The per-head RMSNorms of the local query and key heads (QK-norm): `per_element` bytes
    per element of q and k (eager: `eager_norm_kept`, as the other norms; compiled: the input
    in the activation dtype) plus an fp32 reciprocal RMS per head and token; 0 without
    QK-norm. Q/K/V biases keep nothing (their gradient needs only the output's)."""
    model, tp = layer.model, layer.plan.tp
    if not model.qk_norm:
        return 0.0
    width = model.q_width / tp + local_kv_width(model, tp)
    return (per_element * width + 4 * width / model.head_dim) * layer.sb


def loss_chunk_tokens(tokens: float, local_vocab: float) -> float:
    """Tokens per chunk of fivefold's fused head loss: at most `loss_chunk_logits` logits of
    the local vocabulary, at least one token."""
    return max(1.0, min(tokens, EAGER.loss_chunk_logits // max(1, int(local_vocab))))


def eager_head_loss_bytes(model: ModelSpec, plan: ParallelPlan, waiting: int = 0) -> float:
    """fivefold-eager: the LM head and loss of one micro-batch at their largest, N = b s/cp
    tokens against the local vocabulary V/t (`EagerProfile.fused_head_loss`): in the forward,
    the input gradient (e N h), under TP the gathered input (e N h), one chunk's logits and
    temporaries and, over several chunks, the fp32 weight-gradient sum (4 V/t h) beside one
    chunk's product (or, at the end, the sum cast to the weight's dtype: e V/t h); in the
    backward, the input and weight gradients twice (kept, and scaled by the loss's gradient).
    `waiting`: micro-batches whose loss waits for its backward (GPipe), each keeping its
    gradients."""
    e = recipe(plan.precision).activation_bytes
    tokens = rank_tokens(plan.micro_batch, model.seq_len, plan)
    vocab = model.vocab / plan.tp
    if not EAGER.fused_head_loss:
        return tokens * vocab * (EAGER.loss_parallel_logit_bytes + 4 * waiting)
    chunk = loss_chunk_tokens(tokens, vocab)
    rows = e * tokens * model.hidden
    per_logit = EAGER.chunk_logit_fp32_bytes + (e if e < 4 else 0.0)
    forward = rows * (2 if plan.tp > 1 else 1) + per_logit * chunk * vocab
    if tokens > chunk:
        forward += (4 + e) * vocab * model.hidden
    kept = rows + e * vocab * model.hidden
    return max(forward, 2 * kept) + waiting * kept


def compiled_norm_bytes(layer: LayerTokens) -> float:
    """A compiled block's two RMSNorms (`CompiledProfile`): the block input in fp32 and the
    output projection's output in the activation dtype (the MLP norm's input is recomputed
    from it), /tp under SP; per norm the fp32 reciprocal RMS per token and the output the next
    matmul keeps (gathered under TP+SP)."""
    e, sb, h = layer.e, layer.sb, layer.model.hidden
    inputs = COMPILED.norm_inputs_fp32 * 4 + COMPILED.norm_inputs_activation_dtype * e
    return (inputs * sb * h + 2 * 4 * sb) / layer.rdiv + 2 * e * sb * h


def fp8_recomputed_bytes(layer: LayerTokens) -> float:
    """Bytes per dense layer that FP8 linears under compile do not keep
    (`CompiledProfile.fp8_recomputed`: a tensor only when every linear reading it converts,
    `fivefold.specs.float8.fp8_linears`; less the tensorwise scales the converted linears keep;
    0 without FP8)."""
    model, plan = layer.model, layer.plan
    if plan.fp8 == "none":
        return 0.0
    converted = fp8_linears(model, plan.fp8, False)
    reads = {w.reads for w in converted}
    mlp_in = "mlp" in reads if model.mlp == "swiglu" else model.ffn in {
        w.out_features for w in converted}  # fmt: skip
    all_qkv = sum(w.reads == "x" for w in converted) == 3
    kept_by = {
        "attention_norm": (model.hidden, all_qkv),
        "mlp_norm": (model.hidden, mlp_in),
        "swiglu_product": (
            model.ffn / plan.tp if model.mlp == "swiglu" else 0.0,
            model.ffn in {w.in_features for w in converted},
        ),
    }
    dropped = (
        layer.e
        * layer.sb
        * sum(width for name in COMPILED.fp8_recomputed for width, ok in [kept_by[name]] if ok)
    )
    if plan.fp8 == "tensorwise":
        dropped -= len(converted) * COMPILED.fp8_tensorwise_scale_bytes
    return dropped


def fp8_tensor_parallel_bytes(layer: LayerTokens) -> float:
    """What torchao's float8 TP styles change in an eager dense layer's saved tensors (tp > 1,
    tensorwise, `fp8_tensor_parallel`; compiled blocks are not measured with them): they cast a
    linear's input before the module, so the FP8 copy is saved instead of the high-precision
    input where that was its only reader (an input cast before its gather: the gathered norm
    output; the MLP down projection's input), beside it where it stays needed (a colwise
    linear's own copy of a high-precision gathered input; the output projection's input, the
    attention output), with one fp32 scale per cast (measured by
    tests/parallel/test_fp8_tensor_parallel.py)."""
    model, plan, e, sb = layer.model, layer.plan, layer.e, layer.sb
    if plan.tp == 1:
        return 0.0
    fp8 = fp8_tensor_parallel(model, plan.fp8, False)
    h, t = model.hidden, plan.tp
    out = -(e - 1) * sb * h * sum(fp8.gathered_inputs) + sb * h * fp8.local_casts
    wo, w2 = fp8.gathered_grads
    out += sb * model.q_width / t * wo - (e - 1) * sb * model.ffn / t * w2
    return out + 4.0 * (sum(fp8.gathered_inputs) + fp8.local_casts + fp8.rowwise)


def autocast_weight_bytes(layer: LayerTokens) -> float:
    """A compiled block under autocast (one process: tp = ep = 1), `CompiledProfile.
    autocast_weight_copies`: its linears' weight copies in the compute dtype, e bytes per
    weight (the router's included), none for the linears FP8 converts (`fp8_linears`)."""
    model, plan, moe, e = layer.model, layer.plan, layer.moe, layer.e
    if not COMPILED.autocast_weight_copies or e >= 4:  # the process keeps fp32 weights
        return 0.0
    lp = layer_params_per_rank(model, moe, 1, 1)
    weights = lp.dense + lp.experts + (model.hidden * model.experts if moe else 0.0)
    if model.qkv_bias:  # no bias copy is kept: a bias's gradient needs only the output's
        weights -= model.q_width + 2 * model.kv_width
    weights -= sum(w.params for w in fp8_linears(model, plan.fp8, moe))
    return e * weights


def _compiled_bytes(layer: LayerTokens, opts: MemoryOptions) -> float:
    """What a compiled block keeps (`CompiledProfile`): the eager count with the compiled norms
    and SwiGLU; MoE layers keep their eager expert part (the expert loop breaks the graph)."""
    model, e = layer.model, layer.e
    total = _eager_bytes(layer)
    total += compiled_norm_bytes(layer) - 2 * eager_norm_bytes(layer)
    total += qk_norm_bytes(layer, e) - qk_norm_bytes(layer, eager_norm_kept(e))
    if not opts.fsdp_wrapped:  # FSDP2 casts the weights it gathers; autocast copies them
        total += autocast_weight_bytes(layer)
    if layer.moe:
        return total
    if model.mlp == "swiglu":
        saved = EAGER.swiglu_saved - COMPILED.swiglu_saved
        total -= saved * e * layer.sb * model.ffn / layer.plan.tp
    return total - fp8_recomputed_bytes(layer)


def _eager_bytes(layer: LayerTokens) -> float:
    """What autograd keeps for one block of fivefold's eager runtime (see `EagerProfile`)."""
    model, plan, moe, e, sb = layer.model, layer.plan, layer.moe, layer.e, layer.sb
    t = plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    s = model.seq_len / plan.cp
    total = 2 * eager_norm_bytes(layer) + qk_norm_bytes(layer, eager_norm_kept(e))
    if layer.policy == "selective":  # the core re-runs: its inputs q, k, v and its output are kept
        total += e * sb * (2 * q + 2 * kv)
    else:
        kv_kept = q if EAGER.kv_expanded else kv
        total += e * sb * (2 * q + 2 * kv_kept)  # q, k, v as SDPA keeps them, and its output
        total += 4 * sb * model.heads / t  # fp32 log-sum-exp
        total += EAGER.mask_bytes * plan.micro_batch * s * s
    if not moe:
        ffn_saved = EAGER.swiglu_saved if model.mlp == "swiglu" else 2
        return total + ffn_saved * e * sb * model.ffn / t
    own = sb / moe_token_split(plan)  # the tokens this rank routes (its 1/tp of them)
    k = model.top_k
    # Each token's k copies: dispatched (grouped by expert) and gathered back for the gate
    # multiply, with their (whole) expert SwiGLU intermediates.
    fe = model.expert_ffn / plan.etp
    total += k * (2 * e * own * model.hidden + EAGER.swiglu_saved * e * own * fe)
    total += model.shared_experts * EAGER.swiglu_saved * e * sb * model.expert_ffn / t
    # The router: fp32 probabilities [N, E], top-k probabilities and renormalised gates [N, k]
    # with their sum [N], three int64 index vectors [N k] (top-k, gather, inverse), the
    # load-balancing loss's expert fractions [E] and the grouped matmul's int32 offsets [E].
    total += 4 * own * model.experts + 8 * own * k + 4 * own + 3 * 8 * own * k
    return total + 2 * 4 * model.experts


def _stored_bytes(layer: LayerTokens, opts: MemoryOptions) -> float:
    """What the fused-kernel (Korthikanti) model keeps for one layer."""
    model, plan, moe, e, sb = layer.model, layer.plan, layer.moe, layer.e, layer.sb
    h, t = model.hidden, plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    heads = model.heads / t
    s = model.seq_len / plan.cp
    # Replicated (SP region): 2 norm inputs + QKV input + MLP input.
    region = 4 * e * sb * h
    qk_norm_inputs = e * sb * (q + kv) if model.qk_norm else 0.0  # local query and key heads
    if opts.dropout:
        region += 2 * sb * h  # one-byte dropout masks after attention and MLP
    total = region / layer.rdiv + qk_norm_inputs
    # Attention core inputs and output.
    total += e * sb * (q + 2 * kv)  # Q, K, V
    total += e * sb * q  # attention output = output projection input (kept by wo)
    if layer.policy != "selective":
        if opts.attention_kernel == "flash":
            total += 4 * sb * heads  # fp32 log-sum-exp
        else:
            scores = heads * s * sb  # a/t * s^2 * b elements
            total += e * scores
            if opts.dropout:
                total += scores + e * scores  # mask + dropout output
    # Selective recompute re-runs the attention core in the backward: its scores (or flash
    # log-sum-exp) are not kept; Q, K, V (its inputs) and its output (wo's input) are.
    # MLP.
    if not moe:
        f = model.ffn / t
        total += (3 if model.mlp == "swiglu" else 2) * e * sb * f
    else:
        own, fe = sb / moe_token_split(plan), model.expert_ffn / plan.etp  # own tokens
        total += model.top_k * (e * own * h + 3 * e * own * fe)  # dispatched copies + experts
        total += model.shared_experts * 3 * e * sb * fe / t  # tensor-parallel
        total += 4 * own * model.experts  # fp32 router probabilities
    return total


def _alternate_matmul_bytes(layer: LayerTokens) -> float:
    """torchtitan's op-level SAC keeps the layer input, the outputs of wq, wv, w1 and w2 (the
    odd matmuls), and the attention output with its log-sum-exp; the rest is recomputed."""
    model, e, sb, t = layer.model, layer.e, layer.sb, layer.plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    f = model.ffn / t
    kept = e * sb * model.hidden / layer.rdiv  # checkpoint input
    kept += e * sb * (q + kv + f + model.hidden)  # wq, wv, w1, w2 outputs
    kept += e * sb * q + 4 * sb * model.heads / t  # attention output and log-sum-exp
    return kept


def chunk_activation_bytes(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    chunk: int,
    options: MemoryOptions | None = None,
) -> float:
    """Activations of one virtual stage for one micro-batch on one rank (without the one-layer
    working set of full recompute, which `stage_memory` adds once per rank)."""
    opts = options or MemoryOptions()
    n_dense, n_moe = chunk_layers(model, counts, chunk)
    total = n_dense * layer_activation_bytes(model, plan, False, opts)
    if n_moe:
        total += n_moe * layer_activation_bytes(model, plan, True, opts)
    if opts.activation_model != "korthikanti":
        return total
    layer = layer_tokens(model, plan)
    if chunk == len(counts) - 1:
        if opts.eager:
            total += eager_norm_bytes(layer)
        else:
            total += 2 * layer.e * layer.sb * model.hidden / layer.rdiv
    if opts.eager:
        total += eager_rope_bytes(model, plan, opts, n_dense + n_moe)
    if chunk == 0 and opts.eager:
        total += EAGER.index_bytes * layer.sb
    return total


def eager_rope_bytes(model: ModelSpec, plan: ParallelPlan, opts: MemoryOptions, layers: int):
    """fivefold-eager: the RoPE cos and sin tables [b, s/cp, 1, head_dim] one chunk keeps for a
    micro-batch: a compute-dtype copy per block where FSDP2 casts the blocks' inputs
    (`EagerProfile.rope_cast_per_block`), else the fp32 pair shared by the chunk's layers."""
    rec = recipe(plan.precision)
    one = 2 * rank_tokens(plan.micro_batch, model.seq_len, plan) * model.head_dim
    if opts.fsdp_wrapped and rec.compute_dtype != "fp32" and EAGER.rope_cast_per_block:
        return layers * one * rec.activation_bytes
    return one * 4 if EAGER.rope_tables_per_chunk else 0.0


def pipeline_boundary_bytes(model: ModelSpec, plan: ParallelPlan) -> float:
    """One micro-batch's tensor at a stage boundary (hidden states or their gradient): b x s/cp
    x h elements, sequence-sharded over tp under SP, in the activation dtype."""
    layer = layer_tokens(model, plan)
    return layer.e * layer.sb * model.hidden / layer.rdiv
