"""fivefold.model: the Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU/GELU, optional MoE).

model = build_model(spec)                     # meta device, no memory
model.to_empty(device="cpu"); model.init_weights(seed=0)
logits = model(tokens, positions=None, doc_ids=None)   # [B, T] -> fp32 [B, T, V]
loss = cross_entropy_loss(logits, labels) + model.aux_loss()
model.head_in_loss = True                      # training: hidden states out, the head fused
loss = head_loss(model, model(tokens), labels)  # into the loss (never [B, T, V] fp32 logits)
"""

from fivefold.model.attention import Attention, AttentionCore
from fivefold.model.attention_blocks import block_attention
from fivefold.model.document_layout import Block, Chunk, DocumentLayout, Span, document_blocks
from fivefold.model.feed_forward import FeedForward
from fivefold.model.init import canonical_fqn, init_module_weights, param_seed
from fivefold.model.loss import IGNORE_INDEX, cross_entropy_loss, head_loss, linear_cross_entropy
from fivefold.model.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoE,
    Routing,
    TokenDispatcher,
    load_balancing_loss,
    route,
)
from fivefold.model.norms import RMSNorm
from fivefold.model.rope import apply_rope, rope_cos_sin
from fivefold.model.transformer import Transformer, TransformerBlock, build_model

__all__ = [
    "IGNORE_INDEX",
    "Attention",
    "AttentionCore",
    "Block",
    "Chunk",
    "DocumentLayout",
    "FeedForward",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "RMSNorm",
    "Routing",
    "Span",
    "TokenDispatcher",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "block_attention",
    "build_model",
    "canonical_fqn",
    "cross_entropy_loss",
    "document_blocks",
    "head_loss",
    "init_module_weights",
    "linear_cross_entropy",
    "load_balancing_loss",
    "param_seed",
    "rope_cos_sin",
    "route",
]
