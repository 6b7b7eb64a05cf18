"""From a precision recipe name to what the runtime does: fp32, or bf16 compute over fp32 weights.

The recipes in `fivefold.specs.precision` describe bytes per parameter for the planner. At run
time fivefold keeps fp32 master weights, gradients and Adam state; when the recipe's compute
dtype is bf16, forward and backward run in bf16: bf16 autocast in a single process, FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16)` in the parallel runtime (`data_parallel`). Both ask
`resolve_precision`, the one resolution. Recipes computing in anything else (fp8) are planning
recipes, refused by `ParallelPlan.problems` before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.errors import ConfigError
from fivefold.parallel.device import real_bf16
from fivefold.specs.plan import RUNTIME_COMPUTE_DTYPES
from fivefold.specs.precision import recipe as precision_recipe


@dataclass(frozen=True)
class RuntimePrecision:
    recipe: str  # plan.precision
    compute_dtype: str  # "fp32" or "bf16": the dtype matmuls run in (and MFU's peak column)
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32 compute)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype forward and backward compute in."""
        return self.autocast_dtype or torch.float32

    def describe(self) -> str:
        if self.autocast_dtype is None:
            return f"{self.recipe} (fp32 compute)"
        return f"{self.recipe} (fp32 weights, bf16 compute)"


def resolve_precision(name: str, device: torch.device) -> RuntimePrecision:
    """The runtime precision of recipe `name` on `device`; ConfigError if the device lacks it."""
    spec = precision_recipe(name)
    assert spec.compute_dtype in RUNTIME_COMPUTE_DTYPES, "refused by ParallelPlan.problems"
    if spec.compute_dtype == "fp32":
        return RuntimePrecision(name, "fp32", None)
    if device.type == "cuda" and not real_bf16():
        raise ConfigError(
            f"plan.precision = {name!r} needs bf16, which "
            f"{torch.cuda.get_device_name(device)} only emulates (slowly) or lacks; set "
            "plan.precision = 'fp32'."
        )
    return RuntimePrecision(name, "bf16", torch.bfloat16)
