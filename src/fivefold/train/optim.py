"""AdamW over the parameters a rank owns, with weight decay on matrices only.

Matrices (embeddings, projections, experts: `ndim >= 2`) are decayed; vectors (RMSNorm weights,
biases) are not, as in GPT-2/Llama training recipes. Parameters shared by several modules (tied
embeddings) appear once.
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


def build_optimizer(model_parts: Iterable[nn.Module], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with the config's peak lr, betas, eps and weight decay (foreach kernels)."""
    return torch.optim.AdamW(
        param_groups(model_parts, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
