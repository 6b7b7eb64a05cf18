"""Which Hugging Face family a fivefold model is, and back: Llama, Qwen2 (biases on Q, K and V)
and Qwen3 (RMSNorm of each query and key head). The three share Llama's tensor names; the
variants add theirs (`VARIANT_TENSORS`) and a few `config.json` fields (`family_config_fields`).
"""

from __future__ import annotations

from typing import Any

from fivefold.errors import CheckpointError
from fivefold.specs.model import ModelSpec

IMPORTABLE_FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# fivefold layer tensor -> transformers' name under `model.layers.<i>.`
VARIANT_TENSORS = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen's sliding-window fields: read by `fivefold.specs.hf_config` (a window is then refused by
# `ModelSpec.runtime_problems`), written as "no window" on export.
_QWEN_WINDOW_FIELDS = frozenset(
    ["use_sliding_window", "sliding_window", "max_window_layers", "layer_types"]
)


def model_fields(family: str, llama_fields: frozenset[str]) -> frozenset[str]:
    """The `config.json` fields that define a model of `family` (Llama's, for Qwen minus the
    bias switches its family fixes, plus its window fields)."""
    if family == "qwen2":
        return (llama_fields - {"attention_bias", "mlp_bias"}) | _QWEN_WINDOW_FIELDS
    if family == "qwen3":
        return (llama_fields - {"mlp_bias"}) | _QWEN_WINDOW_FIELDS
    return llama_fields


def hf_family(spec: ModelSpec) -> str:
    """The family `export --hf` writes `spec` as; CheckpointError when none has its attention."""
    if spec.qkv_bias and spec.qk_norm:
        raise CheckpointError(
            "cannot export to Hugging Face: model.qkv_bias and model.qk_norm together have no "
            "Hugging Face form (Qwen2 has the biases without QK-norm; Qwen3's attention_bias "
            "also puts a bias on the output projection)."
        )
    return "qwen2" if spec.qkv_bias else "qwen3" if spec.qk_norm else "llama"


def family_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """`config.json` fields naming the family of `spec` and, for Qwen, no sliding window."""
    family = hf_family(spec)
    out: dict[str, Any] = {"architectures": [ARCHITECTURES[family]], "model_type": family}
    if family == "llama":
        return out | {"attention_bias": False, "mlp_bias": False}
    out |= {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.layers,
        "layer_types": ["full_attention"] * spec.layers,
    }
    return out | ({"attention_bias": False} if family == "qwen3" else {})
