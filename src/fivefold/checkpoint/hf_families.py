"""Which Hugging Face family a fivefold model is, and back: Llama, Mistral (a sliding window in
every layer), Qwen2 (biases on Q, K and V), Qwen3 (RMSNorm of each query and key head), the two
Qwen with a window in the layers `layer_types` names, and the mixtures of experts Mixtral
(Llama's attention) and Qwen3-MoE (Qwen3's), and DeepSeek-V3 (latent attention: tensors in
`hf_deepseek`). They share Llama's tensor names; the variants add theirs (`VARIANT_TENSORS`),
the MoE families their experts' (`expert_names`, `hf_experts`), and each a few `config.json`
fields (`family_config_fields`).
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint import hf_deepseek
from fivefold.checkpoint.hf_experts import (
    DEEPSEEK_EXPERTS,
    MIXTRAL_EXPERTS,
    QWEN_MOE_EXPERTS,
    ExpertNames,
)
from fivefold.errors import CheckpointError
from fivefold.specs.hf_config import LLAMA3_KEYS, YARN_KEYS
from fivefold.specs.model import ModelSpec

IMPORTABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_EXPERT_NAMES = {
    "mixtral": MIXTRAL_EXPERTS,
    "qwen3_moe": QWEN_MOE_EXPERTS,
    "deepseek_v3": DEEPSEEK_EXPERTS,
}
# fivefold layer tensor -> transformers' name under `model.layers.<i>.`
VARIANT_TENSORS = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# The sliding-window fields, read by `fivefold.specs.hf_config`
_QWEN_WINDOW_FIELDS = frozenset(
    ["use_sliding_window", "sliding_window", "max_window_layers", "layer_types"]
)
# The experts' fields each MoE family's config defines the model with (read by
# `fivefold.specs.hf_config`; `router_jitter_noise` checked by `fivefold.checkpoint.hf`).
_MOE_FIELDS = {
    "mixtral": frozenset(
        [
            "num_local_experts",
            "num_experts_per_tok",
            "router_aux_loss_coef",
            "router_jitter_noise",
            "sliding_window",
        ]
    ),
    "qwen3_moe": frozenset(
        [
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "router_aux_loss_coef",
        ]
    ),
}
_MISTRAL_WINDOW_FIELDS = frozenset(["sliding_window"])
# transformers' DeepSeek-V3 normalises the query and key-value latents with this epsilon,
# whatever its config's rms_norm_eps; fivefold's latent norms take model.norm_eps
LATENT_NORM_EPS = 1e-6
_LATENT_EPS_REASON = (
    "transformers' DeepSeek-V3 normalises its query and key-value latents with eps 1e-6 "
    "whatever rms_norm_eps says"
)
# DeepSeek-V3's fields: its attention and experts (read by `fivefold.specs.hf_config`), the
# transformers config's derived `qk_head_dim` (checked by `family_problems`), and the published
# config's training settings, which transformers' model does not read (`scoring_func`: checked)
_DEEPSEEK_FIELDS = frozenset(
    [
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "moe_layer_freq",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "rope_interleave",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "scoring_func",
        "topk_method",
        "seq_aux",
        "aux_loss_alpha",
        "ep_size",
        "quantization_config",
    ]
)


def model_fields(family: str, llama_fields: frozenset[str]) -> frozenset[str]:
    """The `config.json` fields that define a model of `family` (Llama's, for Qwen minus the
    bias switches its family fixes, plus its window fields; for MoE plus the experts')."""
    if family == "qwen2":
        return (llama_fields - {"attention_bias", "mlp_bias"}) | _QWEN_WINDOW_FIELDS
    if family in ("qwen3", "qwen3_moe"):
        fields = (llama_fields - {"mlp_bias"}) | _QWEN_WINDOW_FIELDS
        return fields | _MOE_FIELDS.get(family, frozenset())
    if family == "mixtral":  # no attention_bias / mlp_bias keys in MixtralConfig
        return (llama_fields - {"attention_bias", "mlp_bias"}) | _MOE_FIELDS[family]
    if family == "mistral":
        return (llama_fields - {"attention_bias", "mlp_bias"}) | _MISTRAL_WINDOW_FIELDS
    if family == "deepseek_v3":
        return (llama_fields - {"mlp_bias"}) | _DEEPSEEK_FIELDS
    return llama_fields


def family_problems(config: dict[str, Any]) -> list[str]:
    """What a family's `config.json` says that fivefold does not import, beyond the fields
    `fivefold.specs.hf_config` refuses (DeepSeek-V3's quantized weights and scoring)."""
    if config.get("model_type") != "deepseek_v3":
        return []
    out = []
    if config.get("quantization_config"):
        out.append(
            "quantization_config (fp8 weights with block scales): fivefold reads unquantized "
            "weights; dequantize them to bf16 or fp32 first"
        )
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        out.append(f"scoring_func = {config['scoring_func']!r} (DeepSeek-V3's router is sigmoid)")
    eps = config.get("rms_norm_eps", LATENT_NORM_EPS)
    if eps != LATENT_NORM_EPS:
        out.append(f"rms_norm_eps = {eps!r} ({_LATENT_EPS_REASON}; fivefold's would use {eps!r})")
    head = config.get("qk_head_dim")
    parts = (config.get("qk_nope_head_dim"), config.get("qk_rope_head_dim"))
    if head is not None and None not in parts and head != sum(parts):
        out.append(
            f"qk_head_dim = {head!r} is not qk_nope_head_dim + qk_rope_head_dim = {sum(parts)}"
        )
    return out


def _deepseek_problems(spec: ModelSpec) -> list[str]:
    """What a latent-attention `spec` has that DeepSeek-V3 has not."""
    out = []
    if spec.sliding_window:
        out.append(f"model.sliding_window = {spec.sliding_window} (DeepSeek-V3 has no window)")
    if spec.norm_eps != LATENT_NORM_EPS:
        out.append(f"model.norm_eps = {spec.norm_eps} ({_LATENT_EPS_REASON}; set 1e-6)")
    if spec.is_moe and spec.router_score != "sigmoid":
        out.append(f"model.router_score = {spec.router_score!r} (DeepSeek-V3's router is sigmoid)")
    return out


def _moe_problems(spec: ModelSpec, family: str) -> list[str]:
    """What a MoE `spec` has that its Hugging Face family (Mixtral or Qwen3-MoE) has not."""
    out = []
    if spec.shared_experts:
        out.append(
            f"model.shared_experts = {spec.shared_experts} (Mixtral and Qwen3-MoE have none)"
        )
    if spec.qkv_bias:
        out.append("model.qkv_bias with experts (Mixtral and Qwen3-MoE have no Q/K/V biases)")
    if family == "mixtral" and spec.dense_layers:
        out.append(
            f"model.dense_layers = {spec.dense_layers} without model.qk_norm (Mixtral has no "
            "dense layers; Qwen3-MoE's mlp_only_layers, with QK-norm, do)"
        )
    if spec.sliding_window and spec.windowed_layers != spec.layers:
        out.append(
            f"a sliding window in {spec.windowed_layers} of {spec.layers} layers (Mixtral and "
            "Qwen3-MoE slide in every layer or in none)"
        )
    if family == "mixtral" and not spec.router_norm_topk:
        out.append("model.router_norm_topk = false (Mixtral renormalises the top-k gates)")
    return out


def hf_family(spec: ModelSpec) -> str:
    """The family `export --hf` writes `spec` as; CheckpointError when none has its attention
    (or its experts)."""
    if spec.is_mla:
        problems = _deepseek_problems(spec)
        if problems:
            raise CheckpointError(
                "cannot export this latent-attention model as Hugging Face DeepSeek-V3: "
                + "; ".join(problems)
                + "."
            )
        return "deepseek_v3"
    if spec.qkv_bias and spec.qk_norm:
        raise CheckpointError(
            "cannot export to Hugging Face: model.qkv_bias and model.qk_norm together have no "
            "Hugging Face form (Qwen2 has the biases without QK-norm; Qwen3's attention_bias "
            "also puts a bias on the output projection)."
        )
    if spec.is_moe:
        family = "qwen3_moe" if spec.qk_norm else "mixtral"
        problems = _moe_problems(spec, family)
        if problems:
            raise CheckpointError(
                "cannot export this mixture of experts to Hugging Face: "
                + "; ".join(problems)
                + "."
            )
        return family
    if spec.qkv_bias or spec.qk_norm:
        return "qwen2" if spec.qkv_bias else "qwen3"
    if not spec.sliding_window:
        return "llama"
    if spec.windowed_layers != spec.layers:
        raise CheckpointError(
            f"cannot export to Hugging Face: a sliding window in {spec.windowed_layers} of "
            f"{spec.layers} layers without Q/K/V biases or QK-norm has no Hugging Face form "
            "(Mistral slides in every layer; Qwen2 and Qwen3, which name their windowed layers, "
            "have biases or QK-norm)."
        )
    return "mistral"


def _layer_types(spec: ModelSpec) -> list[str]:
    return [
        "sliding_attention" if spec.layer_window(layer) else "full_attention"
        for layer in range(spec.layers)
    ]


def expert_names(spec: ModelSpec) -> ExpertNames | None:
    """How the Hugging Face family of `spec` names its experts (None: a dense model)."""
    return _EXPERT_NAMES[hf_family(spec)] if spec.is_moe else None


def family_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """`config.json` fields naming the family of `spec`, its MLP widths (Mixtral's experts'
    as `intermediate_size`), its experts and its sliding window (or none)."""
    family = hf_family(spec)
    out: dict[str, Any] = {"architectures": [ARCHITECTURES[family]], "model_type": family}
    out["intermediate_size"] = spec.expert_ffn if family == "mixtral" else spec.ffn
    if family == "deepseek_v3":
        return out | hf_deepseek.config_fields(spec)
    if family == "llama":
        return out | {"attention_bias": False, "mlp_bias": False}
    if family == "mistral":
        return out | {"sliding_window": spec.sliding_window}
    if family == "mixtral":
        return out | _mixtral_fields(spec)
    if family == "qwen3_moe":  # a window in every layer or none (`_moe_problems`)
        out |= {
            "use_sliding_window": bool(spec.sliding_window),
            "sliding_window": spec.sliding_window or None,
        }
        out |= {"max_window_layers": spec.layers, **_qwen3_moe_fields(spec)}
        return out | {"attention_bias": False}
    types = _layer_types(spec)
    out |= {
        "use_sliding_window": bool(spec.sliding_window),
        "sliding_window": spec.sliding_window or None,
        "max_window_layers": types.index("sliding_attention")
        if spec.sliding_window
        else spec.layers,
        "layer_types": types,
    }
    return out | ({"attention_bias": False} if family == "qwen3" else {})


def _mixtral_fields(spec: ModelSpec) -> dict[str, Any]:
    return {
        "num_local_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": spec.sliding_window or None,  # every layer or none (`_moe_problems`)
    }


def _qwen3_moe_fields(spec: ModelSpec) -> dict[str, Any]:
    return {
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "moe_intermediate_size": spec.expert_ffn,
        "norm_topk_prob": spec.router_norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(spec.dense_layers)),
        "router_aux_loss_coef": spec.router_aux_loss_coef,
    }


def context_length(spec: ModelSpec) -> int:
    """config.json's max_position_embeddings: the training length, or the length past which
    dynamic RoPE grows its theta (transformers reads it there)."""
    dynamic = spec.rope_scaling_type == "dynamic" and spec.rope_scaling_factor != 1.0
    return spec.rope_original_seq_len if dynamic else spec.seq_len


def rope_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """config.json's RoPE keys for both transformers 4.x and 5.x."""
    scaling: dict[str, Any] = {}
    kind = spec.rope_scaling_type
    if spec.rope_scaling_factor != 1.0:
        keys = {"factor": "rope_scaling_factor"}
        if kind != "dynamic":  # dynamic grows past max_position_embeddings (= its context)
            keys["original_max_position_embeddings"] = "rope_original_seq_len"
        keys |= LLAMA3_KEYS if kind == "llama3" else YARN_KEYS if kind == "yarn" else {}
        scaling = {"rope_type": kind} | {key: getattr(spec, f) for key, f in keys.items()}
        if kind == "yarn" and not spec.rope_attention_factor:
            scaling.pop("attention_factor")  # transformers derives it from the factor
        if spec.rope_mscale_all_dim:  # DeepSeek's softmax scale (latent attention reads it)
            scaling["mscale_all_dim"] = spec.rope_mscale_all_dim
    return {
        "rope_theta": spec.rope_theta,
        "rope_scaling": scaling or None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta} | scaling,
    }
