"""The memory model's assumptions: `MemoryOptions` (activation model, attention kernel,
runtime, the fixed buffers), and what fivefold's own runtime keeps beyond the fused-kernel
formula, eager (`EagerProfile`) and compiled (`CompiledProfile`), one field per mechanism.

Derivations and measurements: docs/planner.md, section 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.units import GiB, MiB

ACTIVATION_MODELS = ("korthikanti", "simple")
ATTENTION_KERNELS = ("flash", "classic")
RUNTIMES = ("fused", "fivefold-eager")


@dataclass(frozen=True)
class EagerProfile:
    """What fivefold's eager runtime keeps beyond the fused-kernel formula, read off autograd's
    saved tensors (`torch.autograd.graph.saved_tensors_hooks`) of this model's block; each field
    is one mechanism, so a runtime change flips one field."""

    # RMSNorm (`fivefold.model.norms`) keeps its input in the activation dtype and the fp32
    # reciprocal RMS per token; before, autograd kept two fp32 copies (input, normalised x).
    norm_fp32_saved: int = 0
    norm_input_saved: int = 1
    # SwiGLU keeps w1 out and w3 out (`silu_mul` recomputes silu in the backward) and their
    # product (w2's input), as the fused kernels; before, also silu(w1 out): 4.
    swiglu_saved: int = 3
    rope_tables_per_chunk: bool = True  # fp32 cos and sin [b, s, 1, head_dim], once a forward
    # FSDP2's `MixedPrecisionPolicy` would cast each block's floating-point inputs to the
    # compute dtype (`cast_forward_inputs`), a cos and sin copy per block; fivefold's blocks
    # take their inputs uncast (`fivefold.parallel.data_parallel`), so the fp32 pair is shared.
    rope_cast_per_block: bool = False
    # The LM head runs inside the loss (`fivefold.model.loss.linear_cross_entropy`): chunks of
    # at most `loss_chunk_logits` logits (its `CHUNK_LOGITS`), each holding at once its fp32
    # logits and their softmax (the logits' gradient), 8 bytes per logit, and that gradient in
    # a narrower compute dtype; the input and weight gradients are made in the forward.
    # Without it the logits were kept whole: under `loss_parallel` (tp > 1) 16 bytes per logit
    # (fp32 log-softmax, a one-hot gradient, exp(log-softmax) and their sum).
    fused_head_loss: bool = True
    loss_chunk_logits: int = 1 << 25
    chunk_logit_fp32_bytes: float = 8.0
    loss_parallel_logit_bytes: float = 16.0
    kv_expanded: bool = False  # K and V kept repeated to every query head (was `repeat_kv`)
    mask_bytes: float = 0.0  # a dense document mask kept per sequence, per (query, key) pair
    index_bytes: int = 8  # the embedding keeps its int64 token indices
    # FSDP2's reduce dtype under bf16 compute (`MixedPrecisionPolicy(reduce_dtype=fp32)`): the
    # gradient shards, and the unsharded gradients it accumulates across micro-batches.
    fsdp_reduce_bytes: float = 4.0
    # FSDP2 on a one-rank mesh (routed experts whose ZeRO group is 1) has no reduce-scatter: it
    # copies `input / divide_factor` into its output, a third reduce-dtype copy beside both.
    fsdp_single_rank_divide_copy: bool = True


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


@dataclass(frozen=True)
class MemoryOptions:
    """Assumptions of the memory model; the defaults describe a modern Llama-style run."""

    activation_model: str = "korthikanti"  # or "simple" (k = 12, `activations.SIMPLE_K`)
    attention_kernel: str = "flash"  # "classic" stores the s^2 softmax output
    dropout: bool = False  # GPT-3-style dropout masks
    cuda_context_bytes: float = 0.75 * GiB
    fragmentation_fraction: float = 0.05
    dp_bucket_bytes: float = 25 * MiB
    logits_bytes_per_element: float = 12.0  # fp32 log-softmax + two fp32 gradients
    selective_policy: str = "attention"  # or "alternate-matmul" (torchtitan's op-level SAC)
    runtime: str = "fused"  # or "fivefold-eager": what fivefold's own eager runtime keeps
    fsdp_wrapped: bool = True  # fivefold-eager: the chunks are FSDP2-wrapped (multi-process)
    compiled: bool = False  # fivefold-eager: the blocks run under torch.compile (`COMPILED`)
    optimizer: str = "adamw"  # "muon": one moment for the blocks' matrices (`planner.muon`)

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
