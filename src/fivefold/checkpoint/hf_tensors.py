"""fivefold tensors <-> Hugging Face tensors for every family `hf_families` maps: the names
(Llama's, the attention variants', a MoE layer's router and per-expert matrices through
`hf_experts`, DeepSeek-V3's through `hf_deepseek`), and the check of a directory's tensors
against the model its config describes, named as the file names them. Experts are written one
matrix per expert (as transformers 4.x and 5.x load them) and read in that layout or in
transformers 5's fused one (`hf_experts.unfuse_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from fivefold.checkpoint import hf_deepseek
from fivefold.checkpoint.hf_experts import (
    ExpertNames,
    experts_from_hf,
    experts_to_hf,
    unfuse_experts,
)
from fivefold.checkpoint.hf_families import VARIANT_TENSORS, expert_names
from fivefold.errors import CheckpointError
from fivefold.model import build_model
from fivefold.specs.model import ModelSpec

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    **VARIANT_TENSORS,
}
_LAYER_BACK = {hf: ff for ff, hf in _LAYER.items()}
_TOP_BACK = {hf: ff for ff, hf in _TOP.items()}
_FF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_PARAMETERS = ("w1", "w2", "w3")
_LISTED = 5  # names shown per kind of mismatch


def to_hf_name(fqn: str) -> str:
    """The HF name of a dense tensor (not a MoE layer's)."""
    if fqn in _TOP:
        return _TOP[fqn]
    match = _FF_LAYER.match(fqn)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    raise CheckpointError(f"parameter {fqn!r} has no Hugging Face counterpart.")


def from_hf_name(name: str) -> str:
    """The fivefold name of a dense HF tensor (not a MoE layer's)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _LAYER_BACK:
        return f"layers.{match.group(1)}.{_LAYER_BACK[match.group(2)]}"
    raise CheckpointError(f"tensor {name!r} has no fivefold counterpart.")


def to_hf_tensors(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fivefold-named tensors of `spec` (full, any device) -> HF-named ones: each MoE layer's
    stacked experts split per expert; a tied LM head left out (HF ties it again)."""
    names = expert_names(spec)
    if spec.is_mla:  # DeepSeek-V3: its experts stacked by hf_deepseek, split here
        return unfuse_experts(names, hf_deepseek.to_hf(dict(tensors), spec))
    out: dict[str, torch.Tensor] = {}
    for fqn, value in tensors.items():
        if spec.tied_embeddings and fqn == "output.weight":
            continue
        layer, moe_name = _moe_part(fqn)
        if moe_name is None:
            out[to_hf_name(fqn)] = value
        elif moe_name.startswith("experts."):
            out |= experts_to_hf(names, layer, moe_name.removeprefix("experts."), value)
        elif moe_name in names.other_tensors():
            out[f"model.layers.{layer}.{names.other_tensors()[moe_name]}"] = value
        else:
            raise CheckpointError(f"parameter {fqn!r} has no Hugging Face counterpart.")
    return out


def from_hf_tensors(
    spec: ModelSpec, tensors: dict[str, torch.Tensor], rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """HF-named tensors (per-expert, as `normalised_hf` makes them, and checked by
    `check_hf_tensors`) -> fivefold-named ones, each MoE layer's experts stacked; a tied LM head
    is the embedding again. Empties `tensors` as it goes, so each expert's matrix is freed once
    stacked (memory: the model once, plus one layer). `rope_interleave`: DeepSeek-V3's config
    key (its RoPE rows in pairs, `hf_deepseek`)."""
    if spec.is_mla:
        out = hf_deepseek.from_hf(tensors, spec, rope_interleave)
        tensors.clear()
        return out
    rest = tensors
    if spec.tied_embeddings:
        rest.pop(_TOP["output.weight"], None)
    out: dict[str, torch.Tensor] = {}
    names = expert_names(spec)
    for layer in range(spec.dense_layers, spec.layers) if names is not None else ():
        out |= _moe_layer_from_hf(names, layer, rest)
    out |= {from_hf_name(name): value for name, value in rest.items()}
    rest.clear()
    if spec.tied_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def _moe_layer_from_hf(names: ExpertNames, layer: int, rest: dict) -> dict[str, torch.Tensor]:
    """One MoE layer's fivefold tensors, taking its HF tensors out of `rest`."""
    out = {}
    for parameter in _EXPERT_PARAMETERS:
        stacked = experts_from_hf(names, layer, parameter, rest)
        for expert in range(stacked.shape[0]):
            del rest[names.expert(layer, expert, parameter)]
        out[f"layers.{layer}.moe.experts.{parameter}"] = stacked
    for ff, hf in names.other_tensors().items():
        out[f"layers.{layer}.moe.{ff}"] = rest.pop(f"model.layers.{layer}.{hf}")
    return out


def normalised_hf(spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A directory's HF tensors (or meta tensors of their shapes) with any fused experts
    (transformers 5) split into the per-expert names the rest of this module reads."""
    names = expert_names(spec)
    return tensors if names is None else unfuse_experts(names, tensors)


def _moe_part(fqn: str) -> tuple[int, str | None]:
    """(layer, name under `layers.<i>.moe.`) of a MoE layer's tensor, else (-1, None)."""
    match = _FF_LAYER.match(fqn)
    if match and match.group(2).startswith("moe."):
        return int(match.group(1)), match.group(2).removeprefix("moe.")
    return -1, None


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model of `spec` has (built on the meta device)."""
    state = build_model(spec).state_dict()
    return {name: tuple(value.shape) for name, value in to_hf_tensors(spec, state).items()}


def check_hf_tensors(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """CheckpointError naming the tensors (HF names, shapes) of `where` that are missing,
    unexpected, or shaped otherwise than the model of `spec` (its config.json) has them."""
    expected = expected_hf_shapes(spec)
    if spec.tied_embeddings:  # a copy of the embedding some tied checkpoints carry
        shapes = {k: v for k, v in shapes.items() if k != _TOP["output.weight"]}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = [
        f"{name} is {list(shapes[name])}, config.json makes it {list(expected[name])}"
        for name in sorted(set(expected) & set(shapes))
        if tuple(shapes[name]) != expected[name]
    ]
    parts = [
        f"{label}: {', '.join(names[:_LISTED])}{' ...' if len(names) > _LISTED else ''}"
        for label, names in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong))
        if names
    ]
    if parts:
        raise CheckpointError(
            f"{where} does not match the model its config.json describes ("
            + "; ".join(parts)
            + "); fivefold reads the tensors transformers' model of the same config has."
        )
