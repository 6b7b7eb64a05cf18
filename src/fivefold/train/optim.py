"""AdamW (or Muon with AdamW, `train.optimizer`) over the parameters a rank owns, with weight
decay on matrices only.

Details: docs/internals.md (`fivefold.train.optim`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.model.torch_features import adamw_kernel
from fivefold.parallel.float8 import float8_problems, needs_scale_precompute, precompute_scales
from fivefold.parallel.lowbit import compiler_problems, lowbit_adamw_class, torchao_problems
from fivefold.parallel.offload import HostOffloadOptimizer
from fivefold.specs.plan import ParallelPlan
from fivefold.train.config import TrainConfig
from fivefold.train.muon import NS_COEFFICIENTS, NS_EPS, MuonAdamW


def muon_matrices(model_parts: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters Muon steps: the 2-D matrices inside the transformer blocks (attention
    and dense MLP projections, MoE routers); embeddings, head, norms, biases and stacked
    [E, F, D] expert weights stay with AdamW."""
    out: dict[int, nn.Parameter] = {}
    for part in model_parts:
        layers = getattr(part, "layers", None)
        for param in layers.parameters() if layers is not None else ():
            if param.requires_grad and param.ndim == 2:
                out.setdefault(id(param), param)
    return list(out.values())


def param_groups(
    model_parts: Iterable[nn.Module], weight_decay: float, exclude: Iterable[nn.Parameter] = ()
) -> list[dict]:
    """Two AdamW groups: decayed matrices and undecayed vectors (each parameter once), without
    the parameters in `exclude` (Muon's)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = {id(p) for p in exclude}
    for part in model_parts:
        for param in part.parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def kernel_choice(groups: list[dict]) -> dict[str, bool]:
    """{"fused": True} when every parameter is a float tensor on a fused-capable device, else
    {"foreach": True} (`torch_features.adamw_kernel`)."""
    return adamw_kernel([p for group in groups for p in group["params"]])


def lever_problems(plan: ParallelPlan, device: torch.device) -> list[str]:
    """What `device` (and this installation) cannot run of the plan's memory levers: FP8
    compute off FP8 GPUs, torchao's optimizers without torchao (or, on CPU, without a C++
    compiler for its compiled update). Layout rules are
    `ParallelPlan.problems`; this is the device half, asked by the launchers (`check_layout`)
    before any process starts and again where each lever is applied."""
    out = float8_problems(plan.fp8, device)
    if plan.optimizer_states != "fp32":
        field = f"plan.optimizer_states = {plan.optimizer_states!r}"
        out += torchao_problems(field) + compiler_problems(field, device)
    return list(dict.fromkeys(out))


def _adamw(groups: list[dict], cfg: TrainConfig, states: str) -> torch.optim.Optimizer:
    """AdamW with the config's peak lr, betas, eps (weight decay per group) and `states`."""
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if states == "fp32":
        return torch.optim.AdamW(groups, **hyper, **kernel_choice(groups))
    problems = torchao_problems(f"plan.optimizer_states = {states!r}")
    if problems:
        raise ConfigError(problems)
    return lowbit_adamw_class(states)(groups, **hyper)


def build_optimizer(
    model_parts: Iterable[nn.Module], cfg: TrainConfig, plan: ParallelPlan | None = None
) -> torch.optim.Optimizer:
    """`train.optimizer` over the parts' parameters: AdamW as the plan's levers ask (default:
    fp32 states, fused else foreach, on the parameters' device), or Muon with AdamW."""
    plan = plan or ParallelPlan()
    parts = list(model_parts)
    if cfg.optimizer == "muon":
        optimizer = build_muon(parts, cfg)
    else:
        optimizer = _built_adamw(parts, cfg, plan)
    if needs_scale_precompute(plan):
        optimizer.register_step_post_hook(lambda *_: precompute_scales(parts))
    return optimizer


def _built_adamw(
    parts: list[nn.Module], cfg: TrainConfig, plan: ParallelPlan
) -> torch.optim.Optimizer:
    groups = param_groups(parts, cfg.weight_decay)
    if plan.offload == "optimizer":
        optimizer = HostOffloadOptimizer(
            groups, lambda host: _adamw(host, cfg, plan.optimizer_states)
        )
    else:
        optimizer = _adamw(groups, cfg, plan.optimizer_states)
    return optimizer


def build_muon(parts: list[nn.Module], cfg: TrainConfig) -> MuonAdamW:
    """Muon over the blocks' matrices (peak lr `train.muon_lr`, else `train.lr`), fp32 AdamW
    over the rest (`fivefold.specs.optimizer.optimizer_plan_problems` refuses the other levers)."""
    matrices = muon_matrices(parts)
    adamw = _adamw(param_groups(parts, cfg.weight_decay, exclude=matrices), cfg, "fp32")
    return MuonAdamW(
        adamw,
        matrices,
        lr=cfg.muon_lr or cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        ns_coefficients=NS_COEFFICIENTS,
        eps=NS_EPS,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
        ns_dtype=cfg.muon_ns_dtype,
    )
