"""A mixture-of-experts layer's tensors between fivefold and Hugging Face checkpoints.

fivefold stacks a layer's E routed experts (`fivefold.model.moe.GroupedExperts`: `w1`, `w3`
[E, F, D], `w2` [E, D, F]); Hugging Face checkpoints keep one matrix per expert and projection
(`...experts.<e>.<gate|up|down>.weight`: [F, D], [F, D], [D, F]), under a module each family
names (`ExpertNames`). The router is one [E, D] matrix in both; shared experts (fivefold: one
SwiGLU of width S x F) are one MLP in the families that have them (DeepSeek-V3).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# GroupedExperts parameter -> the projection it holds (ExpertNames field)
_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}
# fivefold names under `layers.<i>.moe.` that are not routed experts -> ExpertNames field
_SHARED = {"shared_expert.w1.weight": "gate", "shared_expert.w3.weight": "up"}
_SHARED |= {"shared_expert.w2.weight": "down"}
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertNames:
    """How a family names a MoE layer's tensors under `model.layers.<i>.`: `block` the module,
    `gate` / `up` / `down` one expert's projections (fivefold's w1 / w3 / w2), `router` the
    router's matrix under the block, `shared` the shared experts' module (None: none), `extra`
    further (fivefold name under `layers.<i>.moe.`, HF name under the block) pairs, such as a
    router's score-correction bias."""

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate.weight"
    shared: str | None = None
    extra: tuple[tuple[str, str], ...] = ()

    def expert(self, layer: int, expert: int, parameter: str) -> str:
        """The HF name of expert `expert`'s `parameter` (fivefold's w1, w2 or w3) in `layer`."""
        projection = getattr(self, _PROJECTIONS[parameter])
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{projection}.weight"

    def other_tensors(self) -> dict[str, str]:
        """fivefold name under `layers.<i>.moe.` -> HF name under `model.layers.<i>.`, for
        what is not a routed expert (router, shared experts, `extra`)."""
        out = {"router.weight": f"{self.block}.{self.router}"}
        out |= {ff: f"{self.block}.{hf}" for ff, hf in self.extra}
        if self.shared is not None:
            out |= {
                ff: f"{self.block}.{self.shared}.{getattr(self, field)}.weight"
                for ff, field in _SHARED.items()
            }
        return out


MIXTRAL_EXPERTS = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
# Qwen3-MoE's; DeepSeek-V3 names its routed experts the same way
QWEN_MOE_EXPERTS = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
DEEPSEEK_EXPERTS = ExpertNames(
    block="mlp",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    shared="shared_experts",
    extra=(("routing.score_bias", "gate.e_score_correction_bias"),),
)


def experts_to_hf(
    names: ExpertNames, layer: int, parameter: str, stacked: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One stacked GroupedExperts `parameter` (w1, w2 or w3: [E, ...]) of `layer` -> its E
    per-expert HF tensors (contiguous copies, as safetensors stores them)."""
    return {
        names.expert(layer, expert, parameter): stacked[expert].contiguous()
        for expert in range(stacked.shape[0])
    }


def experts_from_hf(
    names: ExpertNames, layer: int, parameter: str, tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The E per-expert HF tensors of `parameter` (w1, w2 or w3) in `layer`, stacked [E, ...];
    E is how many there are from expert 0 on (`hf_tensors.check_hf_tensors` checked them all
    against the model's shapes first)."""
    out = []
    while (name := names.expert(layer, len(out), parameter)) in tensors:
        out.append(tensors[name])
    return torch.stack(out)


def unfuse_experts(names: ExpertNames, tensors: Mapping[str, torch.Tensor]) -> dict:
    """`tensors` with transformers 5's fused experts (`mlp.experts.gate_up_proj` [E, 2F, D],
    `mlp.experts.down_proj` [E, D, F]) split into the per-expert names of `names`, and the router
    of such a layer under `names.block`. Anything else (a fused tensor of another rank or an odd
    2F) is kept as it is, for the shape check to name. Works on meta tensors (shapes only)."""
    out: dict[str, torch.Tensor] = {}
    fused = set()
    for name, value in tensors.items():
        match = _FUSED.match(name)
        if match is None or value.ndim != 3 or value.shape[1] % 2:
            out[name] = value
            continue
        layer = int(match.group(1))
        fused.add(layer)
        if match.group(2) == "down_proj":
            out |= experts_to_hf(names, layer, "w2", value)
        else:
            w1, w3 = value.chunk(2, dim=1)
            out |= experts_to_hf(names, layer, "w1", w1) | experts_to_hf(names, layer, "w3", w3)
    for layer in sorted(fused):
        router = f"model.layers.{layer}.mlp.{names.router}"
        if router in out:
            out[f"model.layers.{layer}.{names.block}.{names.router}"] = out.pop(router)
    return out
