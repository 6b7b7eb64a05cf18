"""The torch APIs fivefold uses that differ across the supported range (torch 2.11 to 2.13; CI
installs 2.13), detected by looking at this installation, never by version number.

`torch_features()` says which are present; the small helpers (`varlen_supports_gqa`, ...) are
what the code paths ask; `torch_problems(recipe)` is the start-up check: for each feature the
recipe needs and this torch lacks, one line naming the API and the setting that needs it (the
launchers raise it as a ConfigError, exit 2, before any process starts, never mid-step).
Features with a fallback are not problems: without `varlen_attn` packed documents take the
per-document kernel, without its `enable_gqa` (torch 2.11) K/V heads are repeated for the call,
without `_set_pg_timeout` the start-up collective timeout is kept for the whole run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

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


@functools.cache
def torch_features() -> dict[str, Feature]:
    """Every detected feature by key (cached: the installation does not change in a run)."""
    varlen = _attr("torch.nn.attention.varlen", "varlen_attn")
    schedules = "torch.distributed.pipelining.schedules"
    c10d = "torch.distributed.distributed_c10d"
    return {
        "varlen_attn": Feature(
            "torch.nn.attention.varlen.varlen_attn",
            varlen is not None,
            "packed documents on CUDA (else the per-document kernel)",
        ),
        "varlen_attn_gqa": Feature(
            "torch.nn.attention.varlen.varlen_attn(enable_gqa=)",
            _has_parameter(varlen, "enable_gqa"),
            "GQA in packed-document attention on CUDA without repeating K/V",
        ),
        "flex_attention": Feature(
            "torch.nn.attention.flex_attention.flex_attention",
            _attr("torch.nn.attention.flex_attention", "flex_attention") is not None,
            "document masks under torch.compile",
        ),
        "grouped_mm": Feature(
            "torch._grouped_mm", hasattr(torch, "_grouped_mm"), "MoE experts (model.experts > 0)"
        ),
        "fully_shard": Feature(
            "torch.distributed.fsdp.fully_shard",
            _attr("torch.distributed.fsdp", "fully_shard") is not None,
            "ZeRO (plan.zero >= 1) and every multi-process run",
        ),
        "replicate_with_fsdp": Feature(
            "torch.distributed._composable.replicate_with_fsdp.replicate",
            _attr("torch.distributed._composable.replicate_with_fsdp", "replicate") is not None,
            "plain data parallelism (plan.zero = 0 with plan.dp_shard > 1)",
        ),
        "schedule_zbv": Feature(
            f"{schedules}.ScheduleZBVZeroBubble",
            _attr(schedules, "ScheduleZBVZeroBubble") is not None,
            "plan.schedule = 'zbv'",
        ),
        "schedule_dualpipev": Feature(
            f"{schedules}.ScheduleDualPipeV",
            _attr(schedules, "ScheduleDualPipeV") is not None,
            "plan.schedule = 'dualpipev'",
        ),
        "dcp_state_dict": Feature(
            "torch.distributed.checkpoint.state_dict.get_state_dict",
            _attr("torch.distributed.checkpoint.state_dict", "get_state_dict") is not None,
            "checkpoints (train.ckpt_every)",
        ),
        "set_pg_timeout": Feature(
            f"{c10d}._set_pg_timeout",
            _attr(c10d, "_set_pg_timeout") is not None,
            "the shorter NCCL timeout after the first step (else the start-up one stays)",
        ),
        "bf16_native_check": Feature(
            "torch.cuda.is_bf16_supported(including_emulation=)",
            _has_parameter(torch.cuda.is_bf16_supported, "including_emulation"),
            "telling native bf16 from emulated (else compute capability >= 8.0)",
        ),
    }


def has(key: str) -> bool:
    return torch_features()[key].available


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
    if plan.pp > 1 and plan.schedule in ("zbv", "dualpipev"):
        out[f"schedule_{plan.schedule}"] = f"plan.schedule = {plan.schedule!r}"
    return out


def torch_problems(model: Any, plan: Any) -> list[str]:
    """One line per API the recipe needs and this torch lacks (empty when it runs)."""
    features = torch_features()
    return [
        f"{setting} needs {features[key].api}, which torch {torch.__version__} lacks; install a "
        f"torch in fivefold's supported range ({SUPPORTED_RANGE}, 2.13 as CI tests) that has it."
        for key, setting in required_features(model, plan).items()
        if not features[key].available
    ]
