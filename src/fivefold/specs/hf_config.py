"""A `ModelSpec` from a Hugging Face `config.json`: Llama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen3-MoE and DeepSeek-V3 (no torch, no transformers).

What each family adds to the Llama decoder, read here the way `transformers` builds it:
- llama: GQA, RoPE (default or llama3 scaling), tied embeddings; `attention_bias` / `mlp_bias`
  (biases on every projection) are refused.
- mistral: a sliding window in every layer (`sliding_window`, 4096 when the key is absent, none
  when null).
- qwen2: biases on Q, K and V; a window (when `use_sliding_window`) in the layers from
  `max_window_layers` on, or as `layer_types` lists them (`sliding_layers` when they are the
  last layers, else the shortest repeating `sliding_pattern`).
- qwen3: RMSNorm of each query and key head, `head_dim` of its own; the window as qwen2.
- mixtral: `num_local_experts` routed SwiGLU experts of width `intermediate_size`, top
  `num_experts_per_tok`, a linear router (softmax, top-k, renormalised); a window when
  `sliding_window` is set.
- qwen3_moe: Qwen3's attention; `num_experts` routed SwiGLU experts of width
  `moe_intermediate_size`, top `num_experts_per_tok`, the top-k gates renormalised when
  `norm_topk_prob`; the layers in `mlp_only_layers` (a leading run of them) keep a dense MLP of
  width `intermediate_size`; a `decoder_sparse_step` other than 1 is refused; a window in every
  layer when `use_sliding_window`.
- deepseek_v3: multi-head latent attention (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`), `first_k_dense_replace` dense leading layers of width
  `intermediate_size`, then `n_routed_experts` experts of width `moe_intermediate_size` (top
  `num_experts_per_tok`) plus `n_shared_experts` always-on ones; yarn RoPE scaling. The router's
  score-correction bias is a buffer, not a parameter, and the multi-token-prediction layers
  (`num_nextn_predict_layers`) are not part of the model `transformers` builds, so neither is
  counted.
Fields that do not change the model's shapes (ids, dtypes, routing details, quantization of the
published weights) are ignored. RoPE comes as transformers 5.x `rope_parameters` or 4.x
`rope_theta` + `rope_scaling`; the two spellings must agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.specs.model import FULL_LETTER, ROPE_SCALING_TYPES, SLIDING_LETTER, ModelSpec

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
LLAMA3_KEYS = {  # HF rope key -> ModelSpec field
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_seq_len",
}
_SCALED_KEYS = {  # what the other scalings carry that a ModelSpec keeps
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_seq_len",
}
YARN_KEYS = {
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "attention_factor": "rope_attention_factor",
    "truncate": "rope_truncate",
}
# RoPE keys that change no frequency of the scalings fivefold reads
_NEUTRAL_ROPE_KEYS = {"rope_type", "rope_theta"}
_YARN_MSCALES = ("mscale", "mscale_all_dim")  # folded into yarn's attention factor
_MISTRAL_DEFAULT_WINDOW = 4096  # MistralConfig's default when the key is absent
_DEFAULT_THETA = {"mixtral": 1e6}  # MixtralConfig's RoPE base when a config names none


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path` (a config.json, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"hf_config {str(path)!r} does not exist; give a Hugging Face config.json."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"hf_config {str(path)!r} is not a readable JSON file ({err}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"hf_config {str(path)!r} must hold a JSON object.")
    return data


def rope_settings(
    config: dict[str, Any], default_theta: float = 10_000.0
) -> tuple[dict[str, Any], list[str]]:
    """ModelSpec RoPE fields (theta, scaling type, factor, ...) from a config (`default_theta`
    when it names none), and the problems: an unknown scaling type, a llama3 scaling missing a
    value, the two spellings disagreeing."""
    new = config.get("rope_parameters") or {}
    old = dict(config.get("rope_scaling") or {})
    if "rope_theta" in config:
        old["rope_theta"] = config["rope_theta"]
    if not isinstance(new, dict) or not isinstance(old, dict):
        return {}, ["rope_parameters / rope_scaling must be objects"]
    new = dict(new)
    for settings in (new, old):
        if "type" in settings and "rope_type" not in settings:
            settings["rope_type"] = settings.pop("type")
    conflicts = [
        f"{key}: rope_parameters says {new[key]!r}, rope_scaling/rope_theta say {old[key]!r}"
        for key in sorted(set(new) & set(old))
        if new[key] != old[key]
    ]
    if conflicts:
        return {}, ["conflicting RoPE settings (" + "; ".join(conflicts) + ")"]
    rope = {**old, **new}
    rope_type = rope.get("rope_type", "default")
    out: dict[str, Any] = {"rope_theta": rope.get("rope_theta", default_theta)}
    if rope_type == "default":
        return out, []
    if rope_type not in ROPE_SCALING_TYPES:
        return out, [f"RoPE type {rope_type!r} (known: default, {', '.join(ROPE_SCALING_TYPES)})"]
    keys = LLAMA3_KEYS if rope_type == "llama3" else _SCALED_KEYS
    required = list(LLAMA3_KEYS) if rope_type == "llama3" else ["factor"]
    missing = [key for key in required if key not in rope]
    if missing:
        return out, [f"{rope_type} RoPE scaling without {', '.join(missing)}"]
    unknown = set(rope) - _NEUTRAL_ROPE_KEYS - set(keys)
    unknown -= set(YARN_KEYS) | set(_YARN_MSCALES) if rope_type == "yarn" else set()
    unknown = sorted(key for key in unknown if rope[key] is not None)
    if unknown and rope_type != "longrope":  # longrope: planned only, counted alike
        return out, [f"{rope_type} RoPE key(s) {', '.join(unknown)} (not understood)"]
    out["rope_scaling_type"] = rope_type
    out |= {field: rope[key] for key, field in keys.items() if key in rope}
    if rope_type == "yarn":
        out |= _yarn_settings(rope)
    return out, []


def _yarn_settings(rope: dict[str, Any]) -> dict[str, Any]:
    """yarn's ModelSpec fields beyond factor and context: betas, truncation and the attention
    factor (as transformers derives it from mscale / mscale_all_dim when both are set)."""
    out = {YARN_KEYS[key]: rope[key] for key in YARN_KEYS if rope.get(key) is not None}
    mscale, mscale_all_dim = (rope.get(key) for key in _YARN_MSCALES)
    factor = float(rope["factor"])
    if "rope_attention_factor" not in out and mscale and mscale_all_dim and factor > 1:

        def scaled(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0

        out["rope_attention_factor"] = scaled(float(mscale)) / scaled(float(mscale_all_dim))
    return out


def _sliding(config: dict[str, Any], family: str, layers: int) -> dict[str, Any]:
    """ModelSpec window fields (sliding_window, sliding_layers or sliding_pattern) as
    `transformers` sets the family up; ConfigError naming a `layer_types` entry it cannot read."""
    types = config.get("layer_types")
    if family in ("qwen2", "qwen3"):
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        if types is None and window:
            first = int(config.get("max_window_layers", 28))
            types = ["full_attention"] * min(first, layers)
            types += ["sliding_attention"] * (layers - len(types))
    elif family == "mistral":
        window = config.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    elif family == "mixtral":
        window = config.get("sliding_window")
    elif family == "qwen3_moe":
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
    else:
        return {}
    if not window:
        return {}
    if types is None:
        return {"sliding_window": int(window)}  # every layer
    return {"sliding_window": int(window), **_window_layers(types, layers)}


def _window_layers(types: Any, layers: int) -> dict[str, Any]:
    """sliding_layers (the windowed layers are the last ones) or the shortest repeating
    sliding_pattern of `layer_types`."""
    letters = {"sliding_attention": SLIDING_LETTER, "full_attention": FULL_LETTER}
    if not isinstance(types, list) or len(types) != layers or set(types) - set(letters):
        raise ConfigError(
            f"layer_types = {types!r}: fivefold reads one entry per layer ({layers}), each "
            '"sliding_attention" or "full_attention".'
        )
    pattern = "".join(letters[kind] for kind in types)
    count = pattern.count(SLIDING_LETTER)
    if not count:
        return {"sliding_window": 0}
    if pattern.endswith(SLIDING_LETTER * count):
        return {"sliding_layers": count}
    period = next(n for n in range(1, layers + 1) if pattern == (pattern[:n] * layers)[:layers])
    return {"sliding_pattern": pattern[:period]}


def _family_problems(config: dict[str, Any], family: str) -> list[str]:
    out = []
    if family not in FAMILIES:
        return [
            f"model_type = {family!r}: fivefold reads {', '.join(FAMILIES)} configs; describe "
            "the model in [model] fields instead"
        ]
    if config.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act = {config.get('hidden_act')!r} (these families' MLP is SwiGLU)")
    if config.get("mlp_bias"):
        out.append("mlp_bias = true (biases on the MLP are not modelled)")
    if config.get("attention_bias") and family != "qwen2":
        out.append("attention_bias = true (a bias on every attention projection is not modelled)")
    if family == "deepseek_v3" and int(config.get("moe_layer_freq", 1)) != 1:
        out.append(f"moe_layer_freq = {config['moe_layer_freq']} (fivefold reads 1)")
    if family == "qwen3_moe":
        out += _qwen3_moe_layer_problems(config)
    missing = [
        key
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        if key not in config
    ]
    if missing:
        out.append(f"missing fields {', '.join(missing)}")
    return out


def _qwen3_moe_layer_problems(config: dict[str, Any]) -> list[str]:
    """Qwen3-MoE's dense layers fivefold cannot place: every `decoder_sparse_step`-th layer
    sparse, or dense layers other than a leading run (fivefold's `dense_layers`)."""
    out = []
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        out.append(
            f"decoder_sparse_step = {step!r} (fivefold's MoE models have every layer sparse "
            "after the leading dense ones; only 1 is read)"
        )
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or sorted(dense) != list(range(len(dense))):
        out.append(
            f"mlp_only_layers = {dense!r} (fivefold's dense layers are a leading run 0, 1, ..., "
            "k-1; other patterns are not read)"
        )
    return out


def _moe_fields(config: dict[str, Any], family: str, layers: int) -> dict[str, Any]:
    if family == "qwen3_moe":
        experts = int(config.get("num_experts", config.get("num_local_experts", 128)))
        dense = len(config.get("mlp_only_layers") or [])
        if not experts or dense >= layers:
            return {}
        return {
            "experts": experts,
            "top_k": int(config.get("num_experts_per_tok", 8)),
            "expert_ffn": int(config.get("moe_intermediate_size", 768)),
            "dense_layers": dense,
            "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
            "router_norm_topk": bool(config.get("norm_topk_prob", False)),
        }
    if family == "mixtral":
        return {
            "experts": int(config.get("num_local_experts", 8)),
            "top_k": int(config.get("num_experts_per_tok", 2)),
            "expert_ffn": int(config["intermediate_size"]),
            "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
        }
    if family == "deepseek_v3" and config.get("n_routed_experts"):
        dense = min(int(config.get("first_k_dense_replace", 0)), layers)
        if dense >= layers:
            return {}
        return {
            "experts": int(config["n_routed_experts"]),
            "top_k": int(config.get("num_experts_per_tok", 8)),
            "expert_ffn": int(config["moe_intermediate_size"]),
            "shared_experts": int(config.get("n_shared_experts") or 0),
            "dense_layers": dense,
            **_deepseek_router(config),
        }
    return {}


def _deepseek_router(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's sigmoid router (`fivefold.model.routers`), transformers' defaults; the
    balancing speed and the auxiliary loss are DeepSeek-V3's training settings (gamma = 0.001,
    alpha = 0.0001), not in the config."""
    groups = int(config.get("n_group") or 1)
    return {
        "router_score": "sigmoid",
        "router_groups": groups if groups > 1 else 0,
        "router_top_groups": int(config.get("topk_group") or 1) if groups > 1 else 0,
        "routed_scaling": float(config.get("routed_scaling_factor", 2.5)),
        "router_norm_topk": bool(config.get("norm_topk_prob", True)),
        "router_bias_update_speed": 0.001,
        "router_aux_loss_coef": 0.0001,
    }


def _mla_fields(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's attention: head_dim = qk_nope_head_dim + qk_rope_head_dim (transformers'
    `config.head_dim` there is the RoPE part alone, not read)."""
    rope = int(config.get("qk_rope_head_dim", 64))
    scaling = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    yarn = scaling.get("rope_type", scaling.get("type")) == "yarn"
    return {
        "rope_mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0) if yarn else 0.0,
        "attention": "mla",
        "head_dim": int(config.get("qk_nope_head_dim", 128)) + rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(config.get("v_head_dim") or 128),
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "kv_lora_rank": int(config.get("kv_lora_rank", 512)),
        "kv_heads": int(config["num_attention_heads"]),
    }


def spec_from_hf_config(
    config: dict[str, Any], where: str = "config.json", name: str | None = None
) -> ModelSpec:
    """The ModelSpec `transformers` would build from `config` (module docstring); ConfigError
    naming what cannot be read. `name` defaults to the config's `_name_or_path` or family."""
    family = config.get("model_type")
    problems = _family_problems(config, family)
    rope, rope_problems = rope_settings(config, _DEFAULT_THETA.get(family, 10_000.0))
    if rope.get("rope_scaling_type") in ("yarn", "dynamic", "longrope"):
        # dynamic grows theta past max_position_embeddings; the others default to it
        context = config.get("max_position_embeddings", 2048)
        fixed = rope["rope_scaling_type"] == "dynamic" or "rope_original_seq_len" not in rope
        rope["rope_original_seq_len"] = context if fixed else rope["rope_original_seq_len"]
    problems += rope_problems
    if problems:
        raise ConfigError(f"{where} cannot be read: " + "; ".join(problems) + ".")
    try:
        heads = int(config["num_attention_heads"])
        if heads < 1:
            raise ConfigError(f"{where}: num_attention_heads = {heads} must be at least 1.")
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        fields: dict[str, Any] = {
            "name": name or str(config.get("_name_or_path") or f"hf-{family}"),
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "kv_heads": int(config.get("num_key_value_heads") or heads),
            "ffn": int(config["intermediate_size"]),
            "vocab": int(config["vocab_size"]),
            "seq_len": int(config.get("max_position_embeddings", 2048)),
            "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "qkv_bias": family == "qwen2",
            "qk_norm": family in ("qwen3", "qwen3_moe"),
            **_sliding(config, family, layers),
            **{k: int(v) if k == "rope_original_seq_len" else v for k, v in rope.items()},
            **_moe_fields(config, family, layers),
        }
        if family == "deepseek_v3":
            fields |= _mla_fields(config)
        spec = ModelSpec(**fields)
    except (TypeError, ValueError, ZeroDivisionError, KeyError) as err:
        raise ConfigError(
            f"{where} cannot be read: a size or rate is not a number ({err}); fix the config's "
            "value."
        ) from None
    if spec.problems():
        raise ConfigError([f"{where} describes an invalid model:", *spec.problems()])
    return spec
