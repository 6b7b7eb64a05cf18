"""The torch APIs fivefold uses that differ across the supported range (torch 2.11 to 2.13; CI
installs 2.13), detected by looking at this installation, never by version number.

Details: docs/internals.md (`fivefold.model.torch_features`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fivefold.specs.geometry import is_v_shaped

SUPPORTED_RANGE = ">=2.11,<2.14"  # pyproject's dependency; CI installs 2.13.0


@dataclass(frozen=True)
class Feature:
    """One API: where it lives and what in fivefold uses it."""

    api: str  # e.g. "torch.nn.attention.varlen.varlen_attn(enable_gqa=)"
    available: bool
    used_for: str


def _attr(module: str, name: str) -> Any:
    """`module.name`, or None when the module or the attribute is absent."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _has_parameter(fn: Any, name: str) -> bool:
    try:
        return fn is not None and name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _varlen() -> Any:
    return _attr("torch.nn.attention.varlen", "varlen_attn")


_SCHEDULES = "torch.distributed.pipelining.schedules"
_C10D = "torch.distributed.distributed_c10d"
_FUNCOL = "torch.distributed._functional_collectives"
_FSDP_COMMS = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
# key -> (the API, what fivefold uses it for, how to find it); probed one by one, on demand:
# importing some of these modules takes seconds, and most runs need few of them.
FEATURES: dict[str, tuple[str, str, Callable[[], bool]]] = {
    "varlen_attn": (
        "torch.nn.attention.varlen.varlen_attn",
        "packed documents on CUDA (else the per-document kernel)",
        lambda: _varlen() is not None,
    ),
    "varlen_attn_gqa": (
        "torch.nn.attention.varlen.varlen_attn(enable_gqa=)",
        "GQA in packed-document attention on CUDA without repeating K/V",
        lambda: _has_parameter(_varlen(), "enable_gqa"),
    ),
    "flex_attention": (
        "torch.nn.attention.flex_attention.flex_attention",
        "document masks under torch.compile",
        lambda: _attr("torch.nn.attention.flex_attention", "flex_attention") is not None,
    ),
    "grouped_mm": (
        "torch._grouped_mm",
        "MoE experts (model.experts > 0)",
        lambda: hasattr(torch, "_grouped_mm"),
    ),
    "fully_shard": (
        "torch.distributed.fsdp.fully_shard",
        "ZeRO (plan.zero >= 1) and every multi-process run",
        lambda: _attr("torch.distributed.fsdp", "fully_shard") is not None,
    ),
    "replicate_with_fsdp": (
        "torch.distributed._composable.replicate_with_fsdp.replicate",
        "plain data parallelism (plan.zero = 0 with plan.dp_shard > 1)",
        lambda: _attr("torch.distributed._composable.replicate_with_fsdp", "replicate") is not None,
    ),
    "schedule_zbv": (
        f"{_SCHEDULES}.ScheduleZBVZeroBubble",
        "plan.schedule = 'zbv'",
        lambda: _attr(_SCHEDULES, "ScheduleZBVZeroBubble") is not None,
    ),
    "schedule_dualpipev": (
        f"{_SCHEDULES}.ScheduleDualPipeV",
        "plan.schedule = 'dualpipev'",
        lambda: _attr(_SCHEDULES, "ScheduleDualPipeV") is not None,
    ),
    "dcp_state_dict": (
        "torch.distributed.checkpoint.state_dict.get_state_dict",
        "checkpoints (train.ckpt_every)",
        lambda: _attr("torch.distributed.checkpoint.state_dict", "get_state_dict") is not None,
    ),
    "set_pg_timeout": (
        f"{_C10D}._set_pg_timeout",
        "the shorter NCCL timeout after the first step (else the start-up one stays)",
        lambda: _attr(_C10D, "_set_pg_timeout") is not None,
    ),
    "muon": (
        "torch.optim.Muon (its Newton-Schulz and lr scale, torch.optim._muon)",
        "train.optimizer = 'muon' (else fivefold's copy of the same update, fivefold.train.muon)",
        lambda: (
            hasattr(torch.optim, "Muon")
            and _attr("torch.optim._muon", "_zeropower_via_newtonschulz") is not None
            and _attr("torch.optim._muon", "_adjust_lr") is not None
        ),
    ),
    "all_gather_single_autograd": (
        "torch.distributed._functional_collectives.all_gather_single_autograd",
        "plan.cp_kind = 'allgather' (else its torch 2.11 name, all_gather_tensor_autograd)",
        lambda: _attr(_FUNCOL, "all_gather_single_autograd") is not None,
    ),
    "fsdp_custom_comms": (
        "FSDPModule.set_custom_all_gather/_reduce_scatter (DefaultAllGather, "
        "DefaultReduceScatter in torch.distributed.fsdp._fully_shard._fsdp_collectives)",
        "the straggler report's waits inside FSDP's all-gathers and reduce-scatters (else unseen)",
        lambda: (
            _attr("torch.distributed.fsdp", "FSDPModule") is not None
            and hasattr(_attr("torch.distributed.fsdp", "FSDPModule"), "set_custom_all_gather")
            and _attr(_FSDP_COMMS, "DefaultAllGather") is not None
            and _attr(_FSDP_COMMS, "DefaultReduceScatter") is not None
        ),
    ),
    "funcol_wait_tensor": (
        f"{_FUNCOL}.wait_tensor (where AsyncCollectiveTensor waits)",
        "the straggler report's waits inside DTensor's collectives: TP, SP (else unseen)",
        lambda: _attr(_FUNCOL, "wait_tensor") is not None,
    ),
    "default_store": (
        f"{_C10D}._get_default_store",
        "naming the ranks that arrived at a collective that timed out",
        lambda: _attr(_C10D, "_get_default_store") is not None,
    ),
    "bf16_native_check": (
        "torch.cuda.is_bf16_supported(including_emulation=)",
        "telling native bf16 from emulated (else compute capability >= 8.0)",
        lambda: _has_parameter(torch.cuda.is_bf16_supported, "including_emulation"),
    ),
}


FUSED_ADAMW_DEVICE_TYPES = ("cpu", "cuda")  # where torch 2.11-2.13 have a fused AdamW kernel


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's kernel for `params`, as training and calibration build it: {"fused": True} when
    every parameter is a float tensor on a fused-capable device, else {"foreach": True}."""
    fused = all(p.device.type in FUSED_ADAMW_DEVICE_TYPES and p.is_floating_point() for p in params)
    return {"fused": True} if fused else {"foreach": True}


@functools.cache
def available(key: str) -> bool:
    """Whether this torch has feature `key` (cached: the installation does not change)."""
    return bool(FEATURES[key][2]())


def torch_features() -> dict[str, Feature]:
    """Every feature by key, each probed (imports every module concerned)."""
    return {key: Feature(api, available(key), use) for key, (api, use, _) in FEATURES.items()}


def has(key: str) -> bool:
    return available(key)


def varlen_supports_gqa() -> bool:
    """Whether `varlen_attn` takes `enable_gqa` (absent in torch 2.11: repeat K/V instead)."""
    return has("varlen_attn_gqa")


def required_features(model: Any, plan: Any) -> dict[str, str]:
    """Feature key -> the setting that needs it, for a (model, plan) with no fallback."""
    out: dict[str, str] = {"dcp_state_dict": "checkpointing"}
    if plan.world_size > 1:
        out["fully_shard"] = f"a run of {plan.world_size} processes"
    if getattr(model, "experts", 0):
        out["grouped_mm"] = f"model.experts = {model.experts}"
    if plan.zero == 0 and plan.dp_shard * plan.dp_replicate > 1:
        out["replicate_with_fsdp"] = "plan.zero = 0 with data parallelism"
    if is_v_shaped(plan.schedule, plan.pp):
        out[f"schedule_{plan.schedule}"] = f"plan.schedule = {plan.schedule!r}"
    return out


def torch_problems(model: Any, plan: Any) -> list[str]:
    """One line per API the recipe needs and this torch lacks (empty when it runs)."""
    return [
        f"{setting} needs {FEATURES[key][0]}, which torch {torch.__version__} lacks; install a "
        f"torch in fivefold's supported range ({SUPPORTED_RANGE}, 2.13 as CI tests) that has it."
        for key, setting in required_features(model, plan).items()
        if not available(key)
    ]
