"""Precision recipes as data: bytes per parameter for each tenant, and the compute dtype.

`optimizer_bytes` counts everything the optimizer keeps per parameter (fp32 master copy when the
recipe has one, plus Adam's m and v). The recipe name is printed with every memory figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.errors import ConfigError


@dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    compute_dtype: str  # peak-FLOP key in the GPU catalog
    activation_bytes: int  # bytes per stored activation element
    description: str

    @property
    def bytes_per_param(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


RECIPES: dict[str, PrecisionRecipe] = {
    r.name: r
    for r in (
        PrecisionRecipe("fp32", 4, 4, 8, "fp32", 4, "fp32 weights and grads, Adam m and v in fp32"),
        PrecisionRecipe(
            "bf16-mixed",
            2,
            2,
            12,
            "bf16",
            2,
            "bf16 weights and grads; fp32 master weights, m and v (Megatron's 16 B/param)",
        ),
        PrecisionRecipe(
            "bf16-mixed-fp32-grads",
            2,
            4,
            12,
            "bf16",
            2,
            "bf16 weights, fp32 gradient accumulation, fp32 master/m/v (18 B/param)",
        ),
        PrecisionRecipe(
            "fp32-master-bf16-compute",
            4,
            4,
            8,
            "bf16",
            2,
            "fp32 sharded weights and grads with bf16 compute (FSDP2 MixedPrecisionPolicy)",
        ),
        PrecisionRecipe(
            "bf16-no-master",
            2,
            2,
            8,
            "bf16",
            2,
            "bf16 weights and grads, fp32 m and v, no master copy (ZeRO's 2+2+12 less the master)",
        ),
        PrecisionRecipe(
            "fp8-mixed",
            1,
            2,
            6,
            "fp8",
            2,
            "fp8 weights, bf16 grads, 6 B/param optimizer (DeepSeek-V3's FP8 figure)",
        ),
    )
}


def recipe(name: str) -> PrecisionRecipe:
    if name not in RECIPES:
        raise ConfigError(
            f"plan.precision = {name!r} is unknown; choose one of {', '.join(RECIPES)}."
        )
    return RECIPES[name]
