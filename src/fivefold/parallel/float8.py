"""FP8 compute of the linear layers (`plan.fp8`) through torchao's float8 training.

Details: docs/internals.md (`fivefold.parallel.float8`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.parallel.lowbit import import_torchao, torchao_problems
from fivefold.specs.float8 import FP8_DIM_MULTIPLE, HIGH_PRECISION_NAMES, converts_to_fp8
from fivefold.specs.plan import ParallelPlan

# torchao (the optional `lowbit` extra) is imported inside the functions that use it.

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and newer


def float8_problems(fp8: str, device: torch.device) -> list[str]:
    """Why `plan.fp8 = fp8` cannot run on `device` (empty when it can or when fp8 is off)."""
    if fp8 == "none":
        return []
    if device.type != "cuda":
        return [
            f"plan.fp8 = {fp8!r} on {device.type}: FP8 matrix multiplies need a GPU with FP8 "
            f"tensor cores (CUDA compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            "newer); the CPU has no FP8 arithmetic. Set plan.fp8 = 'none' (the planner still "
            "plans FP8 runs with `fivefold plan`)."
        ]
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return [
            f"plan.fp8 = {fp8!r}: {torch.cuda.get_device_name(device)} has compute capability "
            f"{capability[0]}.{capability[1]}; FP8 matrix multiplies need "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (e.g. L4, L40S, H100, H200, "
            "B200). Set plan.fp8 = 'none'."
        ]
    return torchao_problems(f"plan.fp8 = {fp8!r}")


def keeps_high_precision(module: nn.Module, fqn: str) -> bool:
    """True for the linears that stay in the recipe's dtype (see the module docstring)."""
    if not isinstance(module, nn.Linear):
        return True
    if fqn.rsplit(".", 1)[-1] in HIGH_PRECISION_NAMES:
        return True
    out_features, in_features = module.weight.shape
    return bool(in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE)


def float8_config(recipe: str, fsdp: bool):
    """torchao's Float8LinearConfig of `recipe` ("tensorwise" | "rowwise"); FP8 all-gather for
    tensorwise scaling under FSDP2 (rowwise scales are per row of the gathered weight, so its
    weights are gathered in high precision)."""
    import_torchao()
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def apply_float8(chunk: nn.Module, plan: ParallelPlan, device: torch.device) -> list[str]:
    """Swap the chunk's eligible linears for Float8Linear in place (ConfigError on a device
    without FP8); returns the converted FQNs. Works on the meta device."""
    if plan.fp8 == "none":
        return []
    problems = float8_problems(plan.fp8, device)
    if problems:
        raise ConfigError(problems)
    return convert_linears(chunk, plan.fp8, fsdp=plan.zero >= 1)


def fp8_eager_note(plan: ParallelPlan, compile: bool) -> str | None:
    """The warning for FP8 linears without torch.compile (None when it does not apply): eager
    Float8Linear runs its amax, scale and cast kernels unfused around every GEMM and is usually
    slower than bf16."""
    if plan.fp8 == "none" or compile:
        return None
    return (
        f"note: plan.fp8 = {plan.fp8!r} without train.compile: eager FP8 runs its scaling and "
        "casts as separate kernels and is usually slower than bf16; set train.compile = true "
        "(FP8 gains come from the compiled, fused casts)."
    )


def gains_from_fp8(recipe: str):
    """The filter of the linears large enough to run faster in FP8 under `recipe`:
    (module, fqn) -> bool, the planner's rule (`fivefold.specs.float8.converts_to_fp8`)."""

    def gains(module: nn.Module, fqn: str) -> bool:
        out_features, in_features = module.weight.shape
        return converts_to_fp8(recipe, out_features, in_features)

    return gains


def convert_linears(
    chunk: nn.Module, recipe: str, fsdp: bool, skip_small: bool = True
) -> list[str]:
    """The conversion alone (no device check: tests run it on CPU); returns the converted FQNs.
    `skip_small` keeps the linears too small to gain in high precision (`gains_from_fp8`)."""
    config = float8_config(recipe, fsdp)
    from torchao.float8 import convert_to_float8_training

    gains = gains_from_fp8(recipe) if skip_small else (lambda module, fqn: True)
    convert_to_float8_training(
        chunk,
        module_filter_fn=lambda m, fqn: not keeps_high_precision(m, fqn) and gains(m, fqn),
        config=config,
    )
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in chunk.named_modules() if isinstance(module, Float8Linear)]


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (False while torchao is not imported: then
    nothing was converted)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def float8_tp_styles() -> tuple[type, type, type]:
    """torchao's float8 tensor-parallel styles (colwise, rowwise, module-input preparation) for
    tensorwise-scaled Float8Linear: an input sharded over the sequence (SP) is cast to FP8 with
    one global scale before its all-gather, so the gather moves 1 byte per element, and each
    output's gradient is cast to FP8 before the backward all-gather of the rowwise output;
    the reduce-scatters (and all-reduces without SP) move the high-precision partial sums."""
    import_torchao()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def needs_scale_precompute(plan: ParallelPlan) -> bool:
    """Tensorwise FP8 all-gather under FSDP2: scales are computed after each optimizer step."""
    return plan.fp8 == "tensorwise" and plan.zero >= 1


def precompute_scales(model_parts: Iterable[nn.Module]) -> None:
    """After an optimizer step: every FP8 weight's scale in one all-reduce per chunk."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
