"""DeepSeek-V3's tensors in `transformers`' names and layouts, and back (in memory).

What differs from Llama's mapping (`fivefold.checkpoint.hf`):
- latent attention: q_a_proj / q_a_layernorm / q_b_proj (or q_proj), kv_a_proj_with_mqa /
  kv_a_layernorm / kv_b_proj, o_proj;
- the RoPE part of each query head and of the shared key: transformers' `rope_interleave`
  (its default) rotates pairs (x0, x1), (x2, x3), ...; fivefold rotates halves, so those rows
  are reordered evens-then-odds on import (`deinterleave_rope_rows`), which makes the two
  rotations equal; export writes the halves layout with rope_interleave = false;
- MoE layers: the router `mlp.gate.weight` and its `e_score_correction_bias`, the experts
  stacked as `gate_up_proj` [E, 2F, D] (w1 over w3) and `down_proj` [E, D, F], or one tensor
  per expert (`mlp.experts.<e>.gate_proj.weight`, the published checkpoints), the shared
  experts as one MLP.
"""

from __future__ import annotations

import re

import torch

from fivefold.specs.model import ModelSpec

# fivefold layer tensor -> transformers' name under `model.layers.<i>.`
LAYER_TENSORS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.routing.score_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.experts.w2": "mlp.experts.down_proj",
}
TOP_TENSORS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# the tensors whose rows hold RoPE parts: name -> whether per query head
_ROPE_ROWS = {
    "self_attn.q_proj.weight": True,
    "self_attn.q_b_proj.weight": True,
    "self_attn.kv_a_proj_with_mqa.weight": False,
}
_FF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def deinterleave_rope_rows(weight: torch.Tensor, spec: ModelSpec, heads: bool) -> torch.Tensor:
    """Reorder the RoPE rows of q_b_proj / q_proj ([H * (nope + rope), r], `heads`) or of
    kv_a_proj_with_mqa ([kv_lora_rank + rope, D]) from pairs to halves (evens, then odds)."""
    rope = spec.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if not heads:
        return torch.cat([weight[:-rope], weight[-rope:][order]])
    per_head = weight.unflatten(0, (spec.heads, spec.head_dim))
    nope = spec.head_dim - rope
    fixed = torch.cat([per_head[:, :nope], per_head[:, nope:][:, order]], dim=1)
    return fixed.flatten(0, 1)


def to_hf(tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """fivefold's full tensors -> transformers' DeepseekV3ForCausalLM state (rope halves)."""
    out: dict[str, torch.Tensor] = {}
    for fqn, value in tensors.items():
        if fqn in TOP_TENSORS:
            if not (spec.tied_embeddings and fqn == "output.weight"):
                out[TOP_TENSORS[fqn]] = value
            continue
        match = _FF_LAYER.match(fqn)
        prefix, name = f"model.layers.{match.group(1)}.", match.group(2)
        if name == "moe.experts.w1":
            w3 = tensors[fqn.replace("experts.w1", "experts.w3")]
            out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([value, w3], dim=1)
        elif name != "moe.experts.w3":
            out[prefix + LAYER_TENSORS[name]] = value
    return out


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.<e>.{gate,up,down}_proj.weight` -> the stacked form."""
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in tensors.items():
        match = _HF_EXPERT.match(name)
        if match is None:
            out[name] = value
            continue
        layer, expert, kind = match.groups()
        parts.setdefault((layer, kind), {})[int(expert)] = value
    for (layer, kind), experts in parts.items():
        stacked = torch.stack([experts[e] for e in sorted(experts)])
        out[f"model.layers.{layer}.mlp.experts.{kind}_proj"] = stacked
    for layer in {layer for layer, _ in parts}:
        prefix = f"model.layers.{layer}.mlp.experts."
        gate, up = out.pop(prefix + "gate_proj", None), out.pop(prefix + "up_proj", None)
        if gate is not None and up is not None:
            out[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)
    return out


def from_hf(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, rope_interleave: bool
) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV3 tensors (stacked or per-expert) -> fivefold names and layouts.
    Names fivefold does not know are kept as they are (the caller's shape check names them)."""
    back = {hf: ff for ff, hf in LAYER_TENSORS.items()}
    top = {hf: ff for ff, hf in TOP_TENSORS.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in _stack_experts(tensors).items():
        if name in top:
            out[top[name]] = value
            continue
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if match is None:
            out[name] = value
            continue
        prefix, hf_name = f"layers.{match.group(1)}.", match.group(2)
        if hf_name == "mlp.experts.gate_up_proj":
            w1, w3 = value.chunk(2, dim=1)
            out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = w1, w3
            continue
        fqn = prefix + back.get(hf_name, hf_name)
        if rope_interleave and hf_name in _ROPE_ROWS:
            value = deinterleave_rope_rows(value, spec, heads=_ROPE_ROWS[hf_name])
        out[fqn] = value
    if spec.tied_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def config_fields(spec: ModelSpec) -> dict:
    """The DeepseekV3 `config.json` fields beyond Llama's (written by `export --hf`); a model
    without experts as one whose every layer is a leading dense one."""
    nope = spec.head_dim - spec.qk_rope_head_dim
    moe = {
        "n_routed_experts": spec.experts or 1,  # without experts: integers no layer uses
        "num_experts_per_tok": spec.top_k or 1,
        "moe_intermediate_size": spec.expert_ffn or spec.ffn,
        "n_shared_experts": spec.shared_experts,
        "first_k_dense_replace": spec.dense_layers if spec.is_moe else spec.layers,
        "n_group": spec.router_groups or 1,
        "topk_group": spec.router_top_groups or 1,
        "routed_scaling_factor": spec.routed_scaling,
        "norm_topk_prob": spec.router_norm_topk,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layers written
    }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.value_dim,
        "rope_interleave": False,
        "attention_bias": False,
        **moe,
    }
