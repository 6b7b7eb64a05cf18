"""From a precision recipe name to what the runtime does: fp32, or bf16 autocast.

The recipes in `fivefold.spec.precision` describe bytes per parameter for the planner. At run time
a single process keeps fp32 weights, gradients and Adam state and, when the recipe's compute
dtype is bf16 and the device supports it, runs forward and backward under bf16 autocast (so every
bf16 recipe trains as "fp32 master, bf16 compute" here). fp8 recipes are planning-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.errors import ConfigError
from fivefold.spec.precision import recipe as precision_recipe


@dataclass(frozen=True)
class RuntimePrecision:
    recipe: str  # plan.precision
    compute_dtype: str  # "fp32" or "bf16": the dtype matmuls run in (and MFU's peak column)
    autocast_dtype: torch.dtype | None  # None = no autocast

    def describe(self) -> str:
        if self.autocast_dtype is None:
            return f"{self.recipe} (fp32 compute)"
        return f"{self.recipe} (fp32 weights, bf16 autocast)"


def resolve_precision(name: str, device: torch.device) -> RuntimePrecision:
    """The runtime precision of recipe `name` on `device`; ConfigError if it cannot run there."""
    spec = precision_recipe(name)
    if spec.compute_dtype == "fp32":
        return RuntimePrecision(name, "fp32", None)
    if spec.compute_dtype != "bf16":
        raise ConfigError(
            f"plan.precision = {name!r} computes in {spec.compute_dtype}, which the training "
            "runtime does not implement (it is a planning recipe); use 'fp32' or a bf16 recipe "
            "such as 'bf16-mixed'."
        )
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"plan.precision = {name!r} needs bf16, which {torch.cuda.get_device_name(device)} "
            "does not support; set plan.precision = 'fp32'."
        )
    return RuntimePrecision(name, "bf16", torch.bfloat16)
