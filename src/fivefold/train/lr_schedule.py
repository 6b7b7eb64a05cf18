"""Learning rate: linear warmup, then cosine (or linear, or constant) decay to `min_lr`.

`lr_at(step)` is the rate used by optimizer step `step` (0-based). With W warmup steps and N steps
in all: step s < W uses lr * (s + 1) / W; afterwards progress p = (s - W) / max(1, N - W - 1) runs
from 0 at the first post-warmup step to 1 at the last step, and
cosine: min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, linear: lr - (lr - min_lr) * p.
The scheduler itself is torch's `LambdaLR`, so its state is the plain step counter.
"""

from __future__ import annotations

import math

import torch

from fivefold.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based optimizer step `step` (steps past the end stay at the floor)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor times the optimizer's base lr (= cfg.lr) is `lr_at(step)`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
