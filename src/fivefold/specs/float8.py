"""Which linears FP8 training converts (`plan.fp8`): the one rule, read by the planner (no torch)
and by the runtime's conversion filter (`fivefold.parallel.float8`).

The size thresholds are torchao 0.18's `_auto_filter_for_recipe` (measured there on H100: smaller
GEMMs run no faster in FP8 once their casts are paid); tests/test_float8.py checks this rule
against torchao's on a grid of shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.specs.model import ModelSpec, attention_matrices

HIGH_PRECISION_NAMES = ("output", "router")  # module names never converted
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: both GEMM dimensions of a weight multiples of 16


@dataclass(frozen=True)
class Linear:
    """One `nn.Linear` weight of a layer: [out_features, in_features]; `reads`: the input it
    shares with its neighbours (fused into one GEMM by the planner: "x" for Q/K/V, "mlp" for
    the gate and up projections), empty when it reads its own."""

    out_features: int
    in_features: int
    reads: str = ""

    @property
    def params(self) -> int:
        return self.out_features * self.in_features


def converts_to_fp8(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a weight [out_features, in_features] runs its GEMMs in FP8 under `recipe`
    ("tensorwise" | "rowwise"): both dimensions multiples of 16 and large enough to gain."""
    n, k = out_features, in_features
    if n % FP8_DIM_MULTIPLE or k % FP8_DIM_MULTIPLE:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    raise ValueError(f"unknown FP8 recipe {recipe!r}")


def layer_linears(model: ModelSpec, moe: bool) -> list[Linear]:
    """The `nn.Linear` weights of one layer FP8 may convert, in module order: the attention
    projections (`attention_matrices`), then the dense MLP (w1, w2, w3) or a MoE layer's shared
    experts (one SwiGLU of width shared_experts x expert_ffn). Never the router or the LM head
    (`HIGH_PRECISION_NAMES`) nor the routed experts (grouped weights, not nn.Linear)."""
    h = model.hidden
    mats = attention_matrices(model)
    fused = not model.is_mla  # Q, K and V read the same input
    out = [Linear(o, i, "x" if fused and j < 3 else "") for j, (o, i) in enumerate(mats)]
    if moe:
        width, swiglu = model.shared_experts * model.expert_ffn, True
    else:
        width, swiglu = model.ffn, model.mlp == "swiglu"
    if width:
        up = "mlp" if swiglu else ""
        out += [Linear(width, h, up), Linear(h, width)]
        out += [Linear(width, h, up)] if swiglu else []
    return out


def fp8_linears(model: ModelSpec, recipe: str, moe: bool) -> list[Linear]:
    """One layer's linears `recipe` converts (none for "none")."""
    if recipe == "none":
        return []
    return [w for w in layer_linears(model, moe) if converts_to_fp8(recipe, *_shape(w))]


def _shape(w: Linear) -> tuple[int, int]:
    return w.out_features, w.in_features


@dataclass(frozen=True)
class Fp8TensorParallel:
    """What torchao's float8 tensor-parallel styles do in one layer under `recipe` (tensorwise;
    all False / 0 otherwise), the runtime's rule (`fivefold.parallel.tensor_parallel`).
    `gathered_inputs`: (attention, MLP) inputs cast to FP8 before their sequence-parallel
    all-gather, where every linear reading the input converts; `gathered_grads`: (attention
    output, MLP down) projections' output gradients cast to FP8 before the backward all-gather,
    where that rowwise linear converts; `colwise` / `rowwise`: converted linears of each kind;
    `local_casts`: converted colwise linears whose input is gathered in high precision (each
    casts its own FP8 copy of it)."""

    gathered_inputs: tuple[bool, bool] = (False, False)
    gathered_grads: tuple[bool, bool] = (False, False)
    colwise: int = 0
    rowwise: int = 0
    local_casts: int = 0


def fp8_tensor_parallel(model: ModelSpec, recipe: str, moe: bool) -> Fp8TensorParallel:
    """`Fp8TensorParallel` of one layer (none for MLA, which has no tensor-parallel styles)."""
    if recipe != "tensorwise" or model.is_mla:
        return Fp8TensorParallel()
    ok = [converts_to_fp8(recipe, *_shape(w)) for w in layer_linears(model, moe)]
    attention, mlp = ok[:4], ok[4:]  # wq, wk, wv, wo; w1, w2[, w3]
    up = mlp[:1] + mlp[2:]  # w1[, w3]
    inputs = (all(attention[:3]), bool(mlp) and all(up))
    return Fp8TensorParallel(
        gathered_inputs=inputs,
        gathered_grads=(attention[3], bool(mlp) and mlp[1]),
        colwise=sum(attention[:3]) + sum(up),
        rowwise=attention[3] + sum(mlp[1:2]),
        local_casts=(0 if inputs[0] else sum(attention[:3])) + (0 if inputs[1] else sum(up)),
    )
