"""The pieces of attention some families add to Llama's, each chosen from the `ModelSpec`:
biases on the Q, K and V projections (Qwen2/2.5) and an RMSNorm of every query and key head
before RoPE (Qwen3; `fivefold.model.norms.RMSNorm` over head_dim, one weight [Dh] shared by the
heads of each kind); the sliding window of a layer (Mistral, windowed Qwen;
`fivefold.model.sliding_window`)."""

from __future__ import annotations

from typing import Any

from fivefold.model.norms import RMSNorm
from fivefold.specs.model import ModelSpec


def attention_variants(spec: ModelSpec, layer: int = 0) -> dict[str, Any]:
    """`Attention`'s keyword arguments for the variants `spec` asks for in layer `layer`
    (its sliding window: `ModelSpec.layer_window`)."""
    return {
        "qkv_bias": spec.qkv_bias,
        "qk_norm_eps": spec.norm_eps if spec.qk_norm else None,
        "window": spec.layer_window(layer),
    }


def head_norms(head_dim: int, eps: float | None) -> tuple[RMSNorm | None, RMSNorm | None]:
    """(query norm, key norm) over one head's Dh; (None, None) when `eps` is None (no QK-norm)."""
    if eps is None:
        return None, None
    return RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
