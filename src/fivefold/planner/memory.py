"""Memory per GPU, per pipeline stage: the four tenants and the buffers around them.

Bytes everywhere (GiB only at the edges). The model, written from the papers (no library does
this without torch):

Parameters, gradients, optimizer state (`model_state_bytes`): bytes per parameter from the
precision recipe (`fivefold.spec.precision`), divided by the ZeRO sharding degree S according to
the stage (Rajbhandari et al. 2020): stage 0 shards nothing; 1 the optimizer state; 2 also the
gradients; 3 also the parameters. S is dp_shard x cp for dense weights (the ranks that hold the
same weights, the runtime's `dp_shard_cp` axis; with dp_replicate > 1 that is HSDP) and
dp_shard x cp / ep for routed experts. Before ZeRO, tensor parallelism splits attention and MLP
matrices by tp (key/value heads are replicated when tp exceeds them), expert parallelism splits
routed experts by ep (and their width by tp), and norms and the router are replicated. The first
stage holds the embedding (vocab-parallel, /tp), the last the final norm and the LM head (a
second copy of the embedding when they are tied and the model is pipelined).

Activations (`layer_activation_bytes`) after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4: per layer per micro-batch, counting what
autograd keeps for the backward, with s tokens per sequence (s / cp with context parallelism),
b sequences, hidden h, query width q, key/value width k (GQA), MLP width f, t = tp, e = bytes
per activation element (2 for bf16):

    attention   : norm input e*s*b*h, QKV input e*sbh, Q, K, V e*sb(q + 2k)/t,
                  attention output (= output projection input) e*sb*q/t,
                  classic kernels: softmax output e*a*s^2*b/t (+ mask a*s^2*b and dropout output
                  e*a*s^2*b/t with attention dropout); flash kernels keep only the fp32
                  log-sum-exp 4*s*b*a/t instead of any s^2 term (the default);
    MLP         : norm input e*sbh, MLP input e*sbh, SwiGLU gate and up (fused: its input 2f and
                  the product f) 3e*sbf/t, or GeLU input and output 2e*sbf/t;
    dropout     : one byte mask per element after attention and after the MLP (2*sbh), only when
                  `dropout=True` (GPT-3-style training; Llama-style models use none).

With e = 2, GeLU f = 4h, q = k = h, classic attention and dropout this is Korthikanti's
sbh(34 + 5as/h); without sequence parallelism the norm inputs, QKV/MLP inputs and dropout masks
(10 sbh) are replicated over the TP group and the rest is divided by t (their eq. 4); with SP
everything is divided by t (eq. 5). Selective recompute drops the attention core's stored tensors
(the s^2 terms; with flash kernels the log-sum-exp); full recompute keeps only each
layer's input (e*sbh, /t with SP) plus one layer's full working set for the layer being
recomputed (fivefold-eager ZeRO-3 without a pipeline: or, where larger, the peak in a block's
backward, `eager_block_backward_excess`). A MoE layer keeps the norm output for the router and
shared experts, the dispatched copies of each token (top_k x e*sbh) with their expert SwiGLU
intermediates (top_k x 3e*sb*f_e/t), the shared experts' intermediates and the fp32 router
probabilities (4*sb*E).

The stage's activations are the per-micro-batch activations of its largest chunk times the peak
number of micro-batches in flight on that rank, which the schedule simulation gives (1F1B: rank
i holds p - i; GPipe: m; interleaved: Narayanan et al. 2021; no pipeline: 1).

With `runtime = "fivefold-eager"` a pipeline rank's peak is found by walking its action list
(`_walk`): per chunk its activations, the per-micro-batch receive slots torch's stages keep
(`pipeline_slots`), outputs and input gradients sent to another rank (held to the step's end),
what a split input-gradient backward keeps for its weight-gradient action
(`split_backward_bytes`), and the gradients of the chunks that already ran a backward.

The simple model of seed 001 (`activation_model="simple"`): k * L * B * S * d * e with k = 12.

Memory levers (`fivefold.planner.levers`): `plan.optimizer_states` changes the optimizer bytes
per parameter (torchao's 8-bit / FP8 Adam states), `plan.offload` moves tenants to host memory
(`StageMemory.host_bytes`, not part of `total`; "all" adds the `offload_staging` buffers), and
FP8 all-gather (`plan.fp8 = "tensorwise"` under ZeRO-3) gathers the converted linears in 1 byte.

"Other" terms, each explicit (`StageMemory.other_terms`): the CUDA context and library
workspaces (`cuda_context_bytes`, 0.75 GiB by default: 0.5-1 GiB is what a CUDA 12 context with
cuBLAS and NCCL reserves); the last stage's logits and loss buffers for one micro-batch,
b * s/cp * V/t logits at 12 bytes each: the loss upcasts the bf16 logits to fp32 and keeps the
fp32 log-softmax (4 bytes) for its backward, which then holds the incoming and the outgoing fp32
gradients (4 + 4) at its peak; ZeRO-3 gathered layers
(two layers' unsharded weights in the compute dtype, the one computing and the one prefetched,
plus one layer's unsharded gradient before its reduce-scatter); DP gradient buckets (two 25 MiB
buckets in flight, PyTorch DDP's default) for ZeRO 0-2; the gathered sequence-parallel input of
one layer; the ring-attention key/value double buffer with CP; the expert-parallel dispatch
buffers (send and receive); and allocator fragmentation, a fixed fraction (5 %) of all the
above, which is the caching allocator's typical reserved-but-unallocated share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from fivefold.errors import ConfigError
from fivefold.planner.levers import (
    gathers_fp8,
    master_bytes,
    resting_param_bytes,
    split_state,
    state_recipe,
)
from fivefold.planner.partition import stage_layer_counts
from fivefold.spec.geometry import (
    chunk_rank,
    chunks_of_rank,
    dense_shard_degree,
    expert_shard_degree,
)
from fivefold.spec.model import (
    ModelSpec,
    attention_extra_params,
    attention_params,
    dense_mlp_params,
    expert_params,
)
from fivefold.spec.plan import ParallelPlan
from fivefold.spec.precision import PrecisionRecipe, recipe
from fivefold.units import GiB, MiB

ACTIVATION_MODELS = ("korthikanti", "simple")
ATTENTION_KERNELS = ("flash", "classic")
RUNTIMES = ("fused", "fivefold-eager")


@dataclass(frozen=True)
class EagerProfile:
    """What fivefold's eager runtime keeps beyond the fused-kernel formula, read off autograd's
    saved tensors (`torch.autograd.graph.saved_tensors_hooks`) of this model's block; each field
    is one mechanism, so a runtime change flips one field."""

    norm_fp32_saved: int = 2  # RMSNorm keeps its fp32 input and the normalised x before weight
    swiglu_saved: int = 4  # w1 out, w3 out, silu(w1 out), their product (fused: 3)
    rope_tables_per_chunk: bool = True  # fp32 cos and sin [b, s, 1, head_dim], once a forward
    # FSDP2's `MixedPrecisionPolicy` casts each block's floating-point inputs to the compute
    # dtype (`cast_forward_inputs`): every block keeps its own cos and sin copy for the rotary
    # multiply's backward, and the fp32 tables are not kept.
    rope_cast_per_block: bool = True
    # With tp > 1 the loss runs under torch's `loss_parallel`, whose backward holds, per logit,
    # the fp32 log-softmax, a `zeros_like` one-hot gradient, exp(log-softmax) and their sum.
    loss_parallel_logit_bytes: float = 16.0
    kv_expanded: bool = False  # K and V kept repeated to every query head (was `repeat_kv`)
    mask_bytes: float = 0.0  # a dense document mask kept per sequence, per (query, key) pair
    index_bytes: int = 8  # the embedding keeps its int64 token indices
    # Under TP the vocab-parallel embedding's weight gradient is a view into a full-vocabulary
    # `embedding_dense_backward` output (V x h), which stays allocated while it accumulates.
    embedding_grad_full_vocab: bool = True
    # FSDP2's reduce dtype under bf16 compute (`MixedPrecisionPolicy(reduce_dtype=fp32)`): the
    # gradient shards, and the unsharded gradients it accumulates across micro-batches.
    fsdp_reduce_bytes: float = 4.0


EAGER = EagerProfile()


@dataclass(frozen=True)
class CompiledProfile:
    """What a block compiled by inductor (`train.compile`) keeps instead of eager autograd's
    tensors: AOTAutograd's partitioner saves a smaller set and recomputes point-wise ops in the
    backward. Read off the compiled block's saved tensors on CPU (torch 2.13, fp32 and bf16
    autocast, FP8 through torchao's emulated casts; tests/test_saved_activations.py), one field
    per mechanism as in `EagerProfile`. Attention (q, k, v, its output, the fp32 log-sum-exp)
    is kept as in eager mode."""

    # RMSNorm keeps no normalised copy: the attention norm reads the block input (fp32), the
    # MLP norm's input (the residual sum) is recomputed from the output projection's output,
    # kept in the activation dtype; each norm keeps its reciprocal RMS and its output.
    norm_inputs_fp32: int = 1
    norm_inputs_activation_dtype: int = 1
    swiglu_saved: int = 3  # w1 out, w3 out and their product; silu(w1 out) is recomputed
    # Under autocast (one process, fp32 weights, bf16 compute) every linear's bf16 weight copy
    # is kept for the backward, e bytes per weight of the block.
    autocast_weight_copies: bool = True
    # FP8 linears (torchao's `matmul_with_hp_or_float8_args` saves its high-precision input
    # and the weight parameter itself, so no weight copy): under compile the inputs that only
    # converted linears read are not kept at all but recomputed from the norms' inputs and
    # re-cast in the backward: both norm outputs and the SwiGLU product.
    fp8_recomputed: tuple[str, ...] = ("attention_norm", "mlp_norm", "swiglu_product")
    fp8_tensorwise_scale_bytes: int = 4  # tensorwise: one fp32 scale per converted linear


COMPILED = CompiledProfile()
SIMPLE_K = 12  # seed 001's per-block multiplier


@dataclass(frozen=True)
class MemoryOptions:
    """Assumptions of the memory model; the defaults describe a modern Llama-style run."""

    activation_model: str = "korthikanti"  # or "simple" (k = 12, seed 001)
    attention_kernel: str = "flash"  # "classic" stores the s^2 softmax output
    dropout: bool = False  # GPT-3-style dropout masks
    cuda_context_bytes: float = 0.75 * GiB
    fragmentation_fraction: float = 0.05
    dp_bucket_bytes: float = 25 * MiB
    logits_bytes_per_element: float = 12.0  # see the module docstring
    selective_policy: str = "attention"  # or "alternate-matmul" (torchtitan's op-level SAC)
    runtime: str = "fused"  # or "fivefold-eager": what fivefold's own eager runtime keeps
    fsdp_wrapped: bool = True  # fivefold-eager: the chunks are FSDP2-wrapped (multi-process)
    compiled: bool = False  # fivefold-eager: the blocks run under torch.compile (`COMPILED`)

    @property
    def eager(self) -> bool:
        return self.runtime == "fivefold-eager"

    def problems(self) -> list[str]:
        out = []
        if self.runtime not in RUNTIMES:
            out.append(f"runtime = {self.runtime!r}: choose one of {', '.join(RUNTIMES)}.")
        if self.activation_model not in ACTIVATION_MODELS:
            out.append(
                f"activation_model = {self.activation_model!r}: choose one of "
                f"{', '.join(ACTIVATION_MODELS)}."
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            out.append(
                f"attention_kernel = {self.attention_kernel!r}: choose one of "
                f"{', '.join(ATTENTION_KERNELS)}."
            )
        if self.selective_policy not in ("attention", "alternate-matmul"):
            out.append(
                f"selective_policy = {self.selective_policy!r}: choose 'attention' or "
                "'alternate-matmul'."
            )
        for name in ("cuda_context_bytes", "fragmentation_fraction", "dp_bucket_bytes"):
            if getattr(self, name) < 0:
                out.append(f"{name} = {getattr(self, name)}: must be >= 0.")
        return out


# ---- the four tenants on raw counts (seed arithmetic) -----------------------------------------
@dataclass(frozen=True)
class Tenants:
    """Bytes per GPU of the four tenants."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def __add__(self, other: Tenants) -> Tenants:
        return Tenants(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
        )


def zero_divisors(zero: int, shard: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) divisors for ZeRO stage `zero` over `shard` ranks."""
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"plan.zero = {zero!r}: ZeRO stage must be 0, 1, 2 or 3.")
    if shard < 1:
        raise ConfigError(f"ZeRO sharding degree = {shard}: must be >= 1.")
    return (shard if zero >= 3 else 1, shard if zero >= 2 else 1, shard if zero >= 1 else 1)


def model_state_bytes(
    n_params: float, precision: PrecisionRecipe | str, zero: int = 0, shard: int = 1
) -> Tenants:
    """Parameter, gradient and optimizer bytes per GPU for `n_params` parameters held by a group
    of `shard` ranks with ZeRO stage `zero` (Rajbhandari et al. 2020)."""
    if n_params < 0:
        raise ConfigError(f"parameter count = {n_params}: must be >= 0.")
    rec = recipe(precision) if isinstance(precision, str) else precision
    dp, dg, do = zero_divisors(zero, shard)
    return Tenants(
        n_params * rec.param_bytes / dp,
        n_params * rec.grad_bytes / dg,
        n_params * rec.optimizer_bytes / do,
    )


def simple_activation_bytes(
    layers: int, hidden: int, micro_batch: int, seq_len: int, element_bytes: float = 2
) -> float:
    """Seed 001's activation estimate: 12 * L * B * S * d * bytes."""
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
    ):
        if value <= 0:
            raise ConfigError(f"{name} = {value}: must be positive.")
    return SIMPLE_K * layers * micro_batch * seq_len * hidden * element_bytes


def training_memory(
    n_params: float,
    *,
    layers: int,
    hidden: int,
    micro_batch: int,
    seq_len: int,
    precision: PrecisionRecipe | str = "bf16-mixed",
    zero: int = 0,
    shard: int = 1,
) -> Tenants:
    """The four tenants of seed 001's budget (simple k = 12 activations) for raw counts."""
    rec = recipe(precision) if isinstance(precision, str) else precision
    state = model_state_bytes(n_params, rec, zero, shard)
    acts = simple_activation_bytes(layers, hidden, micro_batch, seq_len, rec.activation_bytes)
    return Tenants(state.params, state.grads, state.optimizer, acts)


def min_gpus(total_bytes: float, hbm_bytes: float) -> int:
    """GPUs needed if the bytes could be split perfectly: ceil(total / HBM)."""
    if hbm_bytes <= 0:
        raise ConfigError(f"HBM capacity = {hbm_bytes}: must be positive.")
    return max(1, math.ceil(total_bytes / hbm_bytes - 1e-12))


def max_params_unsharded(hbm_bytes: float, precision: PrecisionRecipe | str) -> float:
    """Largest parameter count whose model state fits one GPU without sharding (no activations)."""
    rec = recipe(precision) if isinstance(precision, str) else precision
    return hbm_bytes / rec.bytes_per_param


# ---- weights per rank -------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerParams:
    """Parameters one rank holds for one layer: `dense` (TP-sharded matrices), `replicated`
    (norms, router) and `experts` (routed experts after EP and TP)."""

    dense: float
    replicated: float
    experts: float

    @property
    def total(self) -> float:
        return self.dense + self.replicated + self.experts


def local_kv_width(model: ModelSpec, tp: int) -> float:
    """Key (or value) width per TP rank: kv heads split by tp, one replicated head when tp
    exceeds them (MLA: the mean of a key and a value head, `ModelSpec.kv_head_width`)."""
    return max(model.kv_heads / tp, 1.0) * model.kv_head_width


def heads_per_rank(model: ModelSpec, tp: int) -> int:
    """Query heads each TP rank holds."""
    if model.heads % tp:
        raise ConfigError(f"plan.tp = {tp} must divide model.heads = {model.heads}.")
    return model.heads // tp


def qkv_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of the column-parallel Q, K and V projections on one TP rank."""
    return model.hidden * (model.q_width / tp + 2 * local_kv_width(model, tp))


def attention_params_per_rank(model: ModelSpec, tp: int) -> tuple[float, float]:
    """(TP-sharded, replicated) attention parameters of one layer on one TP rank: Q and O split
    by heads, K and V by kv heads (one replicated head when tp exceeds them); with MLA the
    per-head up projections and O split, the down projections (query and key/value latents)
    replicated. Biases and norms replicated."""
    h = model.hidden
    extra = attention_extra_params(model)
    if model.is_mla:
        down = model.hidden * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim)
        return (attention_params(model) - down) / tp, down + extra
    attn = attention_params(model) - 2 * h * model.kv_width  # wq and wo
    return attn / tp + 2 * h * local_kv_width(model, tp), float(extra)


def layer_params_per_rank(model: ModelSpec, moe: bool, tp: int, ep: int) -> LayerParams:
    h = model.hidden
    attn, replicated = attention_params_per_rank(model, tp)
    norms = 2 * h + replicated
    if not moe:
        return LayerParams(attn + dense_mlp_params(model) / tp, norms, 0.0)
    shared = model.shared_experts * expert_params(model) / tp
    routed = model.experts / ep * expert_params(model) / tp
    return LayerParams(attn + shared, norms + h * model.experts, routed)


def embedding_params_per_rank(model: ModelSpec, tp: int) -> float:
    return model.vocab * model.hidden / tp


def head_params_per_rank(model: ModelSpec, tp: int, pipelined: bool) -> tuple[float, float]:
    """(TP-sharded LM head, replicated final norm) on the last stage; a tied head is the
    embedding itself unless the model is pipelined, when the last stage keeps its own copy."""
    head = 0.0 if model.tied_embeddings and not pipelined else model.vocab * model.hidden / tp
    return head, float(model.hidden)


def chunk_layers(model: ModelSpec, counts: list[int], chunk: int) -> tuple[int, int]:
    """(dense layers, MoE layers) in virtual stage `chunk` given the per-chunk layer counts."""
    start = sum(counts[:chunk])
    stop = start + counts[chunk]
    first_moe = model.dense_layers if model.is_moe else model.layers
    dense = max(0, min(stop, first_moe) - start)
    return dense, counts[chunk] - dense


@dataclass(frozen=True)
class ChunkParams:
    """Parameters one rank holds for one virtual stage: shardable over the dense ZeRO group
    (`dense`, including replicated norms) and over the expert ZeRO group (`experts`)."""

    dense: float
    experts: float
    max_layer: float  # the largest layer's local parameters (ZeRO-3 gather buffer)


def chunk_params(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int
) -> ChunkParams:
    n_dense, n_moe = chunk_layers(model, counts, chunk)
    last = len(counts) - 1
    return params_of(model, plan.tp, plan.ep, n_dense, n_moe, chunk == 0, chunk == last, last > 0)


@lru_cache(maxsize=65536)
def params_of(
    model: ModelSpec,
    tp: int,
    ep: int,
    n_dense: int,
    n_moe: int,
    first: bool,
    last: bool,
    pipelined: bool,
) -> ChunkParams:
    """Parameters of a virtual stage with `n_dense` dense and `n_moe` MoE layers on one rank,
    holding the embedding when `first` and the head when `last`."""
    dl = layer_params_per_rank(model, False, tp, ep)
    dense = n_dense * (dl.dense + dl.replicated)
    experts = 0.0
    largest = dl.total if n_dense else 0.0
    if n_moe:
        ml = layer_params_per_rank(model, True, tp, ep)
        dense += n_moe * (ml.dense + ml.replicated)
        experts = n_moe * ml.experts
        largest = max(largest, ml.total)
    if first:
        dense += embedding_params_per_rank(model, tp)
    if last:
        head, norm = head_params_per_rank(model, tp, pipelined)
        dense += head + norm
    return ChunkParams(dense, experts, largest)


def chunk_state_bytes(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, eager: bool = False
) -> Tenants:
    """Parameter, gradient and optimizer bytes of one virtual stage on one rank's device."""
    return chunk_state(model, plan, counts, chunk, eager)[0]


def eager_state_recipe(rec: PrecisionRecipe, plan: ParallelPlan) -> PrecisionRecipe:
    """The bytes per parameter fivefold's runtime holds for a recipe with an fp32 master copy
    and a narrower compute dtype: FSDP2's `MixedPrecisionPolicy(reduce_dtype=fp32)` leaves fp32
    gradient shards (4 B, `EagerProfile.fsdp_reduce_bytes`), and under ZeRO-3 the fp32 shard
    *is* the master, with no resting compute-dtype copy (parameters 4 B, optimizer the moments
    only; ZeRO-1/2 keep the gathered compute-dtype copy through the step, the recipe's
    parameter tenant). Other recipes, and offloaded state, as the recipe says."""
    master = master_bytes(rec)
    if master <= 0 or rec.compute_dtype == "fp32" or plan.offload != "none":
        return rec
    out = replace(rec, grad_bytes=EAGER.fsdp_reduce_bytes)
    if plan.zero == 3:
        out = replace(out, param_bytes=master, optimizer_bytes=rec.optimizer_bytes - master)
    return out


def chunk_state(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, eager: bool = False
) -> tuple[Tenants, float]:
    """(device tenants, offloaded host bytes) of one virtual stage's model state on one rank,
    with the plan's optimizer states and offload (`fivefold.planner.levers`); `eager`: as
    fivefold's runtime holds it (`eager_state_recipe`)."""
    cp = chunk_params(model, plan, counts, chunk)
    rec = state_recipe(plan)
    held = eager_state_recipe(rec, plan) if eager else rec
    dense_shard, expert_shard = dense_shard_degree(plan), expert_shard_degree(plan)
    total = model_state_bytes(cp.dense, held, plan.zero, dense_shard)
    total = total + model_state_bytes(cp.experts, held, plan.zero, expert_shard)
    if plan.offload == "none":
        return total, 0.0
    host_params = 0.0  # "optimizer" offload of a recipe without a master copy
    if master_bytes(rec) <= 0:
        for n, shard in ((cp.dense, dense_shard), (cp.experts, expert_shard)):
            host_params += n * rec.param_bytes / zero_divisors(plan.zero, shard)[2]
    device, host = split_state(total.params, total.grads, total.optimizer, host_params, plan)
    return Tenants(*device), host


# ---- activations ------------------------------------------------------------------------------
def layer_activation_bytes(
    model: ModelSpec,
    plan: ParallelPlan,
    moe: bool = False,
    options: MemoryOptions | None = None,
    recompute: str | None = None,
) -> float:
    """Bytes one layer keeps for the backward, per micro-batch, on one rank (see module doc)."""
    opts = options or MemoryOptions()
    policy = recompute or plan.recompute
    e = recipe(plan.precision).activation_bytes
    b = plan.micro_batch
    s = model.seq_len / plan.cp
    h, t = model.hidden, plan.tp
    sp = plan.sp and t > 1
    if opts.activation_model == "simple":
        return SIMPLE_K * b * s * h * e
    replicated_div = t if sp else 1  # norm inputs and matmul inputs live in the SP region
    sb = s * b
    if policy == "full":
        return e * sb * h / replicated_div
    if policy == "selective" and opts.selective_policy == "alternate-matmul" and not moe:
        return _alternate_matmul_bytes(model, plan, e, sb, replicated_div)
    if opts.eager:
        if opts.compiled and policy != "full":
            return _compiled_bytes(model, plan, moe, policy, e, sb, replicated_div, opts)
        return _eager_bytes(model, plan, moe, policy, e, sb, replicated_div)
    return _stored_bytes(model, plan, moe, opts, policy, e, sb, replicated_div)


def eager_norm_bytes(model: ModelSpec, e: float, sb: float, rdiv: int) -> float:
    """One eager RMSNorm and the matmul after it: the fp32 input and the normalised tensor
    (plus the fp32 reciprocal RMS per token) in the norm's region (/tp under SP), and the
    output the next matmul keeps, gathered to the full sequence under TP+SP."""
    h = model.hidden
    return (EAGER.norm_fp32_saved * 4 * sb * h + 4 * sb) / rdiv + e * sb * h


def compiled_norm_bytes(model: ModelSpec, e: float, sb: float, rdiv: int) -> float:
    """A compiled block's two RMSNorms (`CompiledProfile`): the block input in fp32 and the
    output projection's output in the activation dtype (the MLP norm's input is recomputed
    from it), /tp under SP; per norm the fp32 reciprocal RMS per token and the output the next
    matmul keeps (gathered under TP+SP)."""
    h = model.hidden
    inputs = COMPILED.norm_inputs_fp32 * 4 + COMPILED.norm_inputs_activation_dtype * e
    return (inputs * sb * h + 2 * 4 * sb) / rdiv + 2 * e * sb * h


def fp8_recomputed_bytes(model: ModelSpec, plan: ParallelPlan, e: float, sb: float) -> float:
    """Bytes per dense layer that FP8 linears under compile do not keep
    (`CompiledProfile.fp8_recomputed`, less the tensorwise scales they keep; 0 without FP8)."""
    if plan.fp8 == "none":
        return 0.0
    widths = {
        "attention_norm": model.hidden,
        "mlp_norm": model.hidden,
        "swiglu_product": model.ffn / plan.tp if model.mlp == "swiglu" else 0.0,
    }
    dropped = e * sb * sum(widths[name] for name in COMPILED.fp8_recomputed)
    if plan.fp8 == "tensorwise":
        linears = 4 + (3 if model.mlp == "swiglu" else 2)  # q, k, v, o and the MLP's
        dropped -= linears * COMPILED.fp8_tensorwise_scale_bytes
    return dropped


def autocast_weight_bytes(model: ModelSpec, plan: ParallelPlan, moe: bool, e: float) -> float:
    """A compiled block under autocast (one process: tp = ep = 1), `CompiledProfile.
    autocast_weight_copies`: its linears' weight copies in the compute dtype, e bytes per
    weight (the router's included), none for the linears FP8 converts (attention, and the
    dense MLP or the shared experts)."""
    if not COMPILED.autocast_weight_copies or e >= 4:  # the process keeps fp32 weights
        return 0.0
    lp = layer_params_per_rank(model, moe, 1, 1)
    weights = lp.dense + lp.experts + (model.hidden * model.experts if moe else 0.0)
    if plan.fp8 != "none":
        mlp = model.shared_experts * expert_params(model) if moe else dense_mlp_params(model)
        weights -= attention_params(model) + mlp
    return e * weights


def _compiled_bytes(model, plan, moe, policy, e, sb, rdiv, opts) -> float:
    """What a compiled block keeps (`CompiledProfile`): the eager count with the compiled norms
    and SwiGLU; MoE layers keep their eager expert part (the expert loop breaks the graph)."""
    total = _eager_bytes(model, plan, moe, policy, e, sb, rdiv)
    total += compiled_norm_bytes(model, e, sb, rdiv) - 2 * eager_norm_bytes(model, e, sb, rdiv)
    if not opts.fsdp_wrapped:  # FSDP2 casts the weights it gathers; autocast copies them
        total += autocast_weight_bytes(model, plan, moe, e)
    if moe:
        return total
    if model.mlp == "swiglu":
        total -= (EAGER.swiglu_saved - COMPILED.swiglu_saved) * e * sb * model.ffn / plan.tp
    return total - fp8_recomputed_bytes(model, plan, e, sb)


def _eager_bytes(model, plan, moe, policy, e, sb, rdiv) -> float:
    """What autograd keeps for one block of fivefold's eager runtime (see `EagerProfile`)."""
    t = plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    s = model.seq_len / plan.cp
    total = 2 * eager_norm_bytes(model, e, sb, rdiv)
    if policy == "selective":  # the core re-runs: its inputs q, k, v and its output are kept
        total += e * sb * (2 * q + 2 * kv)
    else:
        kv_kept = q if EAGER.kv_expanded else kv
        total += e * sb * (2 * q + 2 * kv_kept)  # q, k, v as SDPA keeps them, and its output
        total += 4 * sb * model.heads / t  # fp32 log-sum-exp
        total += EAGER.mask_bytes * plan.micro_batch * s * s
    if not moe:
        ffn_saved = EAGER.swiglu_saved if model.mlp == "swiglu" else 2
        return total + ffn_saved * e * sb * model.ffn / t
    fe = model.expert_ffn / t
    k = model.top_k
    # Each token's k copies: dispatched (grouped by expert) and gathered back for the gate
    # multiply, with their expert SwiGLU intermediates.
    total += k * (2 * e * sb * model.hidden + EAGER.swiglu_saved * e * sb * fe)
    total += model.shared_experts * EAGER.swiglu_saved * e * sb * fe
    # The router: fp32 probabilities [N, E], top-k probabilities and renormalised gates [N, k]
    # with their sum [N], three int64 index vectors [N k] (top-k, gather, inverse), the
    # load-balancing loss's expert fractions [E] and the grouped matmul's int32 offsets [E].
    total += 4 * sb * model.experts + 8 * sb * k + 4 * sb + 3 * 8 * sb * k
    return total + 2 * 4 * model.experts


def _stored_bytes(model, plan, moe, opts, policy, e, sb, rdiv) -> float:
    h, t = model.hidden, plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    heads = model.heads / t
    s = model.seq_len / plan.cp
    # Replicated (SP region): 2 norm inputs + QKV input + MLP input.
    region = 4 * e * sb * h
    if opts.dropout:
        region += 2 * sb * h  # one-byte dropout masks after attention and MLP
    total = region / rdiv
    # Attention core inputs and output.
    total += e * sb * (q + 2 * kv)  # Q, K, V
    total += e * sb * q  # attention output = output projection input (kept by wo)
    if policy != "selective":
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
        fe = model.expert_ffn / t
        total += model.top_k * (e * sb * h + 3 * e * sb * fe)  # dispatched copies + experts
        total += model.shared_experts * 3 * e * sb * fe
        total += 4 * sb * model.experts  # fp32 router probabilities
    return total


def _alternate_matmul_bytes(model, plan, e, sb, rdiv) -> float:
    """torchtitan's op-level SAC keeps the layer input, the outputs of wq, wv, w1 and w2 (the
    odd matmuls), and the attention output with its log-sum-exp; the rest is recomputed."""
    t = plan.tp
    q = model.q_width / t
    kv = local_kv_width(model, t)
    f = model.ffn / t
    kept = e * sb * model.hidden / rdiv  # checkpoint input
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
    e = recipe(plan.precision).activation_bytes
    sp_div = plan.tp if plan.sp and plan.tp > 1 else 1
    sb = plan.micro_batch * model.seq_len / plan.cp
    if chunk == len(counts) - 1:
        if opts.eager:
            total += eager_norm_bytes(model, e, sb, sp_div)
        else:
            total += 2 * e * sb * model.hidden / sp_div
    if opts.eager:
        total += eager_rope_bytes(model, plan, opts, n_dense + n_moe)
    if chunk == 0 and opts.eager:
        total += EAGER.index_bytes * sb
    return total


def eager_rope_bytes(model: ModelSpec, plan: ParallelPlan, opts: MemoryOptions, layers: int):
    """fivefold-eager: the RoPE cos and sin tables [b, s/cp, 1, head_dim] one chunk keeps for a
    micro-batch: a compute-dtype copy per block where FSDP2 casts the blocks' inputs
    (`EagerProfile.rope_cast_per_block`), else the fp32 pair shared by the chunk's layers."""
    rec = recipe(plan.precision)
    one = 2 * plan.micro_batch * model.seq_len / plan.cp * model.head_dim
    if opts.fsdp_wrapped and rec.compute_dtype != "fp32" and EAGER.rope_cast_per_block:
        return layers * one * rec.activation_bytes
    return one * 4 if EAGER.rope_tables_per_chunk else 0.0


# ---- the per-stage total ----------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """Bytes on one pipeline rank: the four tenants and the named "other" terms."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    other_terms: dict[str, float] = field(default_factory=dict)
    # fivefold-eager: the share of the gradient bytes live at the activation peak, those of
    # the chunks that ran a backward of the step before it (FSDP2 allocates them then; above 1
    # where the buffers are larger than the gradients, `eager_embedding_grad_extra`); the
    # optimizer step is a second candidate peak (parameters, gradients and state, activations
    # freed).
    grads_at_peak: float = 1.0
    optimizer_phase: float = 0.0
    host_bytes: float = 0.0  # model state offloaded to host memory (`levers`), not in `total`

    @property
    def other(self) -> float:
        return sum(self.other_terms.values())

    @property
    def total(self) -> float:
        grads = self.grads * self.grads_at_peak
        during = self.params + grads + self.optimizer + self.activations + self.other
        return max(during, self.optimizer_phase)

    def gib(self) -> dict[str, float]:
        """The summary in GiB with the stable key names of `fivefold plan --json`."""
        return {
            "params": self.params / GiB,
            "grads": self.grads / GiB,
            "optimizer": self.optimizer / GiB,
            "activations": self.activations / GiB,
            "other": self.other / GiB,
            "total": self.total / GiB,
        }

    def other_gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.other_terms.items()}


def stage_memory(
    model: ModelSpec,
    plan: ParallelPlan,
    rank: int,
    inflight: int,
    options: MemoryOptions | None = None,
    counts: list[int] | None = None,
) -> StageMemory:
    """Memory of pipeline rank `rank` holding `inflight` micro-batches of chunk activations."""
    opts = options or MemoryOptions()
    problems = opts.problems()
    if problems:
        raise ConfigError(problems)
    counts = counts or stage_layer_counts(model, plan.pp * plan.vpp)
    chunks = list(chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank))
    state = Tenants(0.0, 0.0, 0.0)
    host = 0.0
    for c in chunks:
        on_device, on_host = chunk_state(model, plan, counts, c, opts.eager)
        state, host = state + on_device, host + on_host
    per_chunk = [chunk_activation_bytes(model, plan, counts, c, opts) for c in chunks]
    acts = max(per_chunk) * inflight
    grads_at_peak = 1.0
    if opts.eager:
        e = recipe(plan.precision).activation_bytes
        kept = [split_backward_bytes(model, plan, counts, c, e) for c in chunks]
        grads = [eager_accumulated_grads(model, plan, counts, c, opts) for c in chunks]
        boundary = pipeline_boundary_bytes(model, plan)
        acts, with_grads = eager_peak_activations(
            plan, rank, chunks, per_chunk, grads, kept, boundary
        )
        # FSDP2 allocates a chunk's gradients in its first weight-gradient backward.
        live = sum(g for c, g in zip(chunks, grads, strict=True) if c in with_grads)
        grads_at_peak = live / state.grads if state.grads else 0.0
    other = other_terms(model, plan, counts, chunks, opts, inflight)
    if plan.recompute == "full" and opts.activation_model == "korthikanti":
        working = layer_activation_bytes(model, plan, model.is_moe, opts, recompute="none")
        if opts.eager and len(counts) - 1 in chunks:
            # The last layer is recomputed after the loss's backward has freed the logits.
            working = max(0.0, working - other.get("logits", 0.0))
        if has_block_backward_peak(plan, opts):
            working = max(working, eager_block_backward_excess(model, plan, counts, opts, other))
        acts += working
    if not opts.eager:
        tensors = state.total + acts + sum(other.values())
        other["fragmentation"] = opts.fragmentation_fraction * tensors
        return StageMemory(
            rank, state.params, state.grads, state.optimizer, acts, other, host_bytes=host
        )
    at_rest = other.get("fsdp_param_shards", state.params)  # the weights between steps
    rest = at_rest + state.grads + state.optimizer
    tensors = state.total + acts + sum(other.values()) - (1 - grads_at_peak) * state.grads
    other["fragmentation"] = opts.fragmentation_fraction * max(tensors, rest)
    return StageMemory(
        rank,
        state.params,
        state.grads,
        state.optimizer,
        acts,
        other,
        grads_at_peak,
        rest * (1 + opts.fragmentation_fraction) + opts.cuda_context_bytes,
        host,
    )


# The forward's buffers that are free by the time a block runs its backward.
FORWARD_BUFFERS = ("logits", "ep_dispatch_buffers", "cp_kv_buffers")


def has_block_backward_peak(plan: ParallelPlan, opts: MemoryOptions) -> bool:
    """fivefold-eager, FSDP2 ZeRO-3 without a pipeline, full recompute in eager blocks: the
    peak may sit in a block's backward (`eager_block_backward_excess`) rather than at the
    loss."""
    eager = opts.eager and opts.fsdp_wrapped and not opts.compiled
    full = plan.recompute == "full" and opts.activation_model == "korthikanti"
    return eager and full and plan.zero == 3 and plan.pp * plan.vpp == 1


def eager_block_backward_excess(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    opts: MemoryOptions,
    other: dict[str, float],
) -> float:
    """Bytes by which the peak inside the backward of the second-to-last block (at its
    recomputed MLP activation's backward) exceeds the tensors `stage_memory` counts at the
    loss: the block's saved tensors and gradients in flight, its gathered weights, the
    prefetched block before it, the reduce-scatter input of the block after it and the head's
    gradient, less the forward's buffers, the final norm and the last block's input
    (`has_block_backward_peak`; derivation: docs/plan-check.md)."""
    rec = recipe(plan.precision)
    e, weight_bytes = rec.activation_bytes, compute_bytes(rec)
    t, h, moe = plan.tp, model.hidden, model.is_moe
    rdiv = t if plan.sp and t > 1 else 1
    sb = plan.micro_batch * model.seq_len / plan.cp
    behind = counts[-1] > 1  # a block ran its backward before this one, one waits before it
    freed = sum(other.get(name, 0.0) for name in FORWARD_BUFFERS)
    freed += eager_norm_bytes(model, e, sb, rdiv)
    if behind:
        layers = counts[-1]
        freed += layer_activation_bytes(model, plan, moe, opts)
        freed += eager_rope_bytes(model, plan, opts, layers)
        freed -= eager_rope_bytes(model, plan, opts, layers - 1)
    width, copies = (model.expert_ffn / t, model.top_k) if moe else (model.ffn / t, 1)
    inputs = 2 if moe or model.mlp == "swiglu" else 1  # the activation's inputs (gate, up)
    block = layer_activation_bytes(model, plan, moe, opts, recompute="none")
    # The gradients of the down projection's input and of the activation's inputs are made
    # (1 + inputs), the down projection's input is freed (-1), and under MoE the combined
    # copies (their combine ran its backward).
    block += inputs * e * sb * width * copies
    block -= copies * e * sb * h if moe else 0.0
    block += e * sb * h / rdiv  # the gradient reaching the block's output
    block += h * width * (model.experts / plan.ep if moe else 1) * weight_bytes  # down proj.
    lp = layer_params_per_rank(model, moe, t, plan.ep)
    unit = lp.dense + lp.replicated  # the block's own FSDP unit (routed experts: their own)
    gathered = unit * weight_bytes - fp8_gather_saving(model, plan)
    units = gathered + lp.experts * weight_bytes
    if behind:
        units += gathered + unit * EAGER.fsdp_reduce_bytes
    head_grads = (embedding_params_per_rank(model, t) + h) * weight_bytes  # head, final norm
    return block + units + head_grads - freed


def eager_peak_activations(
    plan: ParallelPlan,
    rank: int,
    chunks: list[int],
    per_chunk: list[float],
    grads: list[float] | None = None,
    retained: list[float] | None = None,
    boundary: float = 0.0,
) -> tuple[float, tuple[int, ...]]:
    """fivefold-eager: (peak activation bytes of pipeline rank `rank`, the chunks whose
    gradients exist at that peak). Without a pipeline: one micro-batch, after grad_accum - 1
    backwards. In a pipeline, the rank's action list is walked (`_walk`) with each
    (micro-batch, chunk) weighing its own chunk's bytes (chunks of one rank may hold different
    layer counts); a chunk's gradients exist at the peak when it had a weight-gradient action
    before it; the peak is that of the activations plus the `grads` (per chunk) of the chunks
    that have them (never in GPipe). `retained`: per chunk, what a split input-gradient
    backward keeps for its weight-gradient action (`split_backward_bytes`); `boundary`: bytes
    of one stage-boundary tensor (a micro-batch's hidden states or their gradient,
    `pipeline_boundary_bytes`)."""
    if plan.pp == 1:
        return max(per_chunk), tuple(chunks) if plan.grad_accum > 1 else ()
    last = plan.pp * plan.vpp - 1
    kept = retained or [0.0] * len(chunks)
    grads = grads or [0.0] * len(chunks)
    table = []
    for c, acts, keep, grad in zip(chunks, per_chunk, kept, grads, strict=True):
        remote_next = c < last and chunk_rank(plan.schedule, plan.pp, c + 1) != rank
        remote_prev = c > 0 and chunk_rank(plan.schedule, plan.pp, c - 1) != rank
        slot = boundary if c > 0 else 0.0
        sent_out = boundary if remote_next else 0.0
        sent_grad = boundary if remote_prev else 0.0
        table.append((c, acts, keep, slot, sent_out, sent_grad, grad))
    return _walk(plan.schedule, plan.pp, plan.vpp, plan.grad_accum, rank, tuple(table))


@lru_cache(maxsize=4096)
def _walk(
    name: str, pp: int, vpp: int, m: int, rank: int, table: tuple
) -> tuple[float, tuple[int, ...]]:
    """The rank's activation peak along its action list. Per chunk, `table` holds (chunk,
    activations, kept by a split input-gradient backward, receive slot, sent output, sent input
    gradient, its gradients once allocated) in bytes, the mechanisms of torch's stages:

    - F adds the chunk's activations; its input is the micro-batch's receive slot, counted
      apart (`pipeline_slot_bytes`), so not twice; an output sent to another rank stays
      referenced by the schedule's pending sends until the step ends;
    - a split input-gradient B adds what it keeps for W; an input gradient sent to another rank
      is the receive buffer's `.grad`, kept until the next step clears it;
    - the release (W, or the full backward: B, or dualpipev's "B" right before the "W" of the
      same micro-batch and chunk) frees the activations and what B kept, but not the slot."""
    from fivefold.planner.schedule import build_schedule

    schedule = build_schedule(name, pp, vpp, m)
    split = schedule.split_backward
    release = "W" if split else "B"
    rows = {row[0]: row[1:] for row in table}
    actions = schedule.actions[rank]
    alive, best, acts, with_grads, graded = 0.0, -1.0, 0.0, (), set()
    pending: dict[tuple[int, int], float] = {}  # what each B kept, until its W
    for i, action in enumerate(actions):
        a, keep, slot, sent_out, sent_grad, _ = rows[action.chunk]
        key = (action.microbatch, action.chunk)
        if action.kind == "F":
            alive += a - slot + sent_out
        elif action.kind == "B":
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            # dualpipev writes its full backwards as a "B" right before the "W" of the same
            # micro-batch and chunk (`fivefold.planner.schedule`); zbv's are all split.
            full = name == "dualpipev" and nxt is not None and nxt[1:] == action[1:]
            full = full and nxt.kind == "W"
            pending[key] = 0.0 if full or not split else keep
            alive += sent_grad + pending[key]
        if action.kind in ("F", "B"):
            total = alive + sum(rows[c][-1] for c in graded)
            if total >= best - 1e-6:  # the last time the peak is reached counts
                best, acts, with_grads = max(best, total), alive, tuple(sorted(graded))
        if action.kind == release:
            alive -= a - slot + pending.pop(key, 0.0)
            graded.add(action.chunk)
    return acts, with_grads


def keeps_unsharded_grads(plan: ParallelPlan, opts: MemoryOptions) -> bool:
    """fivefold-eager: whether the gradients accumulate unsharded across micro-batches (no
    FSDP, ZeRO-0/1, or any stage under pipelining: torch's pipeline stages skip FSDP2's
    reduce-scatter until the last micro-batch); ZeRO-2/3 otherwise reduce-scatter each one."""
    return not opts.fsdp_wrapped or plan.zero <= 1 or plan.pp > 1


def eager_accumulated_grads(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, opts: MemoryOptions
) -> float:
    """fivefold-eager: the gradient bytes virtual stage `chunk` holds once its first backward
    has run: the sharded gradients, or, where they accumulate unsharded
    (`keeps_unsharded_grads`), the chunk's local parameters in the gradient dtype, and the
    first stage's full-vocabulary embedding gradient (`eager_embedding_grad_extra`)."""
    state = chunk_state_bytes(model, plan, counts, chunk, eager=True)
    if not keeps_unsharded_grads(plan, opts):
        return state.grads
    grad_bytes = eager_state_recipe(state_recipe(plan), plan).grad_bytes
    cp = chunk_params(model, plan, counts, chunk)
    held = (cp.dense + cp.experts) * grad_bytes
    return held + (eager_embedding_grad_extra(model, plan) if chunk == 0 else 0.0)


def eager_embedding_grad_extra(model: ModelSpec, plan: ParallelPlan) -> float:
    """fivefold-eager, tp > 1: the bytes by which the first stage's embedding gradient buffer
    exceeds its V/t x h shard while gradients accumulate unsharded (`EagerProfile`), in the
    dtype they accumulate in (`eager_state_recipe`)."""
    if plan.tp == 1 or not EAGER.embedding_grad_full_vocab:
        return 0.0
    rec = eager_state_recipe(state_recipe(plan), plan)
    return rec.grad_bytes * model.vocab * model.hidden * (1 - 1 / plan.tp)


def pipeline_boundary_bytes(model: ModelSpec, plan: ParallelPlan) -> float:
    """One micro-batch's tensor at a stage boundary (hidden states or their gradient): b x s/cp
    x h elements, sequence-sharded over tp under SP, in the activation dtype."""
    sp_div = plan.tp if plan.sp and plan.tp > 1 else 1
    e = recipe(plan.precision).activation_bytes
    return e * plan.micro_batch * model.seq_len / plan.cp * model.hidden / sp_div


def split_backward_bytes(
    model: ModelSpec, plan: ParallelPlan, counts: list[int], chunk: int, e: float
) -> float:
    """fivefold-eager, zbv/dualpipev: what one micro-batch's input-gradient backward of virtual
    stage `chunk` keeps for its weight-gradient backward. torch's `stage_backward_input` holds the
    gradient of every weight's output (read by `stage_backward_weight`): per layer Q, K, V
    (q + 2k)/t, the attention and MLP outputs (h each, region /tp under SP), SwiGLU's gate and
    up (2f/t) and the two RMSNorm outputs (2h); no MoE layers (dense only here)."""
    t = plan.tp
    rdiv = t if plan.sp and t > 1 else 1
    sb = plan.micro_batch * model.seq_len / plan.cp
    h = model.hidden
    per_layer = model.q_width / t + 2 * local_kv_width(model, t) + 2 * model.ffn / t
    per_layer += 4 * h / rdiv
    return counts[chunk] * e * sb * per_layer


def other_terms(
    model: ModelSpec,
    plan: ParallelPlan,
    counts: list[int],
    chunks: list[int],
    opts: MemoryOptions,
    inflight: int = 1,
) -> dict[str, float]:
    """Named buffers of one pipeline rank holding `chunks` with `inflight` micro-batches, in
    bytes (fragmentation excluded)."""
    rec = recipe(plan.precision)
    e = rec.activation_bytes
    tokens = plan.micro_batch * model.seq_len / plan.cp
    out = {"cuda_context": float(opts.cuda_context_bytes)}
    last = len(counts) - 1
    if last in chunks:
        # Every micro-batch in flight on the last stage keeps its fp32 log-softmax (4 bytes per
        # logit); the one in its backward also holds the two fp32 gradients (see module doc).
        # GPipe has all m in flight there; the other schedules run the last stage's backward
        # right after its forward.
        waiting = inflight - 1 if plan.schedule == "gpipe" and plan.pp > 1 else 0
        per_logit = opts.logits_bytes_per_element
        if opts.eager and plan.tp > 1:
            per_logit = EAGER.loss_parallel_logit_bytes
        per_logit += 4 * max(0, waiting)
        out["logits"] = tokens * model.vocab / plan.tp * per_logit
    if opts.eager and plan.pp > 1:
        # torch.distributed.pipelining keeps each in-flight micro-batch's stage output until its
        # backward: the fp32 logits on the last stage (the hidden states elsewhere are walked,
        # `_walk`), and per micro-batch a receive slot for the stage input of every chunk but
        # the first and one for the output gradient of every chunk but the last (allocated at
        # the first step, or holding the last step's hand-over from a chunk on the same rank).
        if last in chunks:
            out["pipeline_stage_outputs"] = (
                tokens * 4 * model.vocab / plan.tp * inflight_of_output(plan, inflight)
            )
        slots = sum((c > 0) + (c < last) for c in chunks) * plan.grad_accum
        out["pipeline_slots"] = slots * pipeline_boundary_bytes(model, plan)
    if opts.eager:
        if opts.fsdp_wrapped:
            out.update(_fsdp_terms(model, plan, counts, chunks, rec))
    elif plan.zero == 3:
        largest = max(chunk_params(model, plan, counts, c).max_layer for c in chunks)
        gathered = largest * compute_bytes(rec) - fp8_gather_saving(model, plan)
        out["zero3_gathered_layers"] = 2 * gathered + largest * rec.grad_bytes
    elif plan.dp * plan.cp > 1:
        out["dp_grad_buckets"] = 2 * opts.dp_bucket_bytes
    if plan.offload == "all":  # FSDP2 offload: the shards crossing PCIe (`levers`)
        largest = max(chunk_params(model, plan, counts, c).max_layer for c in chunks)
        shard = largest / dense_shard_degree(plan)
        out["offload_staging"] = shard * (2 * resting_param_bytes(rec) + rec.grad_bytes)
    if plan.sp and plan.tp > 1 and not opts.eager:  # eager: counted per layer
        out["sp_gathered_input"] = e * tokens * model.hidden
    if plan.cp > 1:
        out["cp_kv_buffers"] = 2 * e * tokens * 2 * local_kv_width(model, plan.tp)
    if model.is_moe and plan.ep > 1:
        out["ep_dispatch_buffers"] = 2 * e * tokens * model.top_k * model.hidden
    return out


def inflight_of_output(plan: ParallelPlan, inflight: int) -> int:
    """Micro-batches whose last-stage output waits for its backward: all of GPipe's, one in the
    schedules that run the last stage's backward right after its forward."""
    return inflight if plan.schedule == "gpipe" else 1


def _fsdp_terms(model, plan, counts, chunks, rec) -> dict[str, float]:
    """fivefold's runtime wraps every chunk in FSDP2 (`replicate` for ZeRO-0), whatever the
    data-parallel degree: there are no DDP buckets. ZeRO-3 keeps the chunk roots' parameters
    (embedding, final norm, head: not re-sharded after forward) gathered through the step; the
    blocks' are gathered one at a time and freed before the loss's backward. ZeRO-0/1/2 gather
    every parameter once per step; with an fp32 compute dtype that gathered copy is the
    recipe's parameter tenant and the sharded fp32 weights at rest come on top
    (bf16 recipes: the shards are the fp32 master copy, already an optimizer tenant). ZeRO-3
    under pipelining keeps whole chunks gathered for the step (their unsharded gradients are
    the gradients at the peak, `eager_accumulated_grads`)."""
    out: dict[str, float] = {}
    if plan.zero == 3 and plan.pp > 1:
        # torch's pipeline stages keep each chunk gathered from its first forward to the end of
        # the step (and skip the gradient reduce-scatter until the last micro-batch, so the
        # gradients they hold are unsharded: `eager_accumulated_grads`).
        local = sum(
            chunk_params(model, plan, counts, c).dense
            + chunk_params(model, plan, counts, c).experts
            for c in chunks
        )
        out["zero3_gathered_chunks"] = local * compute_bytes(rec)
    elif plan.zero == 3:
        root = 0.0
        for c in chunks:
            cp = chunk_params(model, plan, counts, c)
            n_dense, n_moe = chunk_layers(model, counts, c)
            layers = params_of(model, plan.tp, plan.ep, n_dense, n_moe, False, False, False)
            root += cp.dense + cp.experts - layers.dense - layers.experts
        out["zero3_gathered_roots"] = root * compute_bytes(rec)
    elif rec.compute_dtype == "fp32":
        local = sum(
            chunk_params(model, plan, counts, c).dense
            + chunk_params(model, plan, counts, c).experts
            for c in chunks
        )
        shard = dense_shard_degree(plan) if plan.zero >= 1 else 1
        out["fsdp_param_shards"] = local * rec.param_bytes / shard
    return out


def fp8_gather_saving(model: ModelSpec, plan: ParallelPlan) -> float:
    """Bytes by which FP8 all-gather shrinks one gathered layer: its converted linears (the
    TP-sharded matrices of `layer_params_per_rank`) at 1 byte instead of the compute dtype's."""
    if not gathers_fp8(plan):
        return 0.0
    lp = layer_params_per_rank(model, model.is_moe, plan.tp, plan.ep)
    return lp.dense * (compute_bytes(recipe(plan.precision)) - 1)


def compute_bytes(rec: PrecisionRecipe) -> int:
    """Bytes per element of the compute dtype (what ZeRO-3 gathers and matmuls read)."""
    return {"fp8": 1, "bf16": 2, "fp16": 2}.get(rec.compute_dtype, 4)


def memory_key(plan: ParallelPlan) -> ParallelPlan:
    """The plan with the fields stage memory does not depend on reset (a cache key): the
    micro-batch count enters only through the in-flight count, dp_replicate only through
    whether there is data parallelism at all."""
    return replace(plan, grad_accum=1, dp_replicate=min(plan.dp_replicate, 2))


@lru_cache(maxsize=65536)
def _cached_stage_memory(model, key, rank, inflight, options, counts) -> StageMemory:
    return stage_memory(model, key, rank, inflight, options, list(counts))


def rank_signature(plan: ParallelPlan, counts: tuple[int, ...], rank: int) -> tuple:
    """What a rank's costs depend on: per chunk, its layer count and whether it is the first or
    the last virtual stage. Ranks with equal signatures hold equal work and memory."""
    last = len(counts) - 1
    chunks = chunks_of_rank(plan.schedule, plan.pp, plan.vpp, rank)
    return tuple((counts[c], c == 0, c == last) for c in chunks)


def all_stage_memory(
    model: ModelSpec,
    plan: ParallelPlan,
    inflight: list[int] | tuple[int, ...],
    options: MemoryOptions | None = None,
) -> list[StageMemory]:
    """Memory of every pipeline rank given the peak in-flight micro-batches per rank."""
    opts = options or MemoryOptions()
    counts = tuple(stage_layer_counts(model, plan.pp * plan.vpp))
    key = memory_key(plan)
    if opts.eager:  # whether gradients are live at the peak depends on the micro-batch count
        key = replace(key, grad_accum=plan.grad_accum)
    first_rank: dict[tuple, int] = {}
    out = []
    for r in range(plan.pp):
        sig = (rank_signature(plan, counts, r), int(inflight[r]))
        if model.is_moe or opts.eager:  # MoE: layers differ by position; eager: by schedule
            sig = (sig, r)
        rep = first_rank.setdefault(sig, r)
        mem = _cached_stage_memory(model, key, rep, int(inflight[r]), opts, counts)
        out.append(mem if rep == r else replace(mem, stage=r))
    return out
