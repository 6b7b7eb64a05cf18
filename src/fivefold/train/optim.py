"""AdamW over the parameters a rank owns, with weight decay on matrices only.

Matrices (embeddings, projections, experts: `ndim >= 2`) are decayed; vectors (RMSNorm weights,
biases) are not, as in GPT-2/Llama training recipes. Parameters shared by several modules (tied
embeddings) appear once. The update runs torch's fused AdamW kernel (one kernel over all
parameters, CPU and CUDA, DTensor shards included) where every parameter's device has one, else
the foreach (multi-tensor) implementation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fivefold.train.config import TrainConfig


def param_groups(model_parts: Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and undecayed vectors (each parameter once)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
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


FUSED_DEVICE_TYPES = ("cpu", "cuda")  # where torch 2.13 has a fused AdamW kernel


def kernel_choice(groups: list[dict]) -> dict[str, bool]:
    """{"fused": True} when every parameter is a float tensor on a fused-capable device, else
    {"foreach": True}."""
    params = [p for group in groups for p in group["params"]]
    fused = all(p.device.type in FUSED_DEVICE_TYPES and p.is_floating_point() for p in params)
    return {"fused": True} if fused else {"foreach": True}


def build_optimizer(model_parts: Iterable[nn.Module], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with the config's peak lr, betas, eps and weight decay (fused, else foreach)."""
    groups = param_groups(model_parts, cfg.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **kernel_choice(groups),
    )
