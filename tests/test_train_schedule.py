"""Learning-rate schedule and optimizer parameter groups against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.model import build_model
from fivefold.specs.presets import model_preset
from fivefold.train.config import TrainConfig
from fivefold.train.lr_schedule import build_scheduler, lr_at
from fivefold.train.optim import build_optimizer


def cfg(**kw) -> TrainConfig:
    base = {"steps": 11, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2}
    return TrainConfig(**(base | kw))


def test_warmup_is_linear_from_lr_over_warmup():
    c = cfg()
    assert lr_at(0, c) == pytest.approx(0.5e-3)
    assert lr_at(1, c) == pytest.approx(1e-3)


def test_cosine_decays_to_min_lr_at_the_last_step():
    c = cfg()  # 9 post-warmup steps (2..10): progress (s - 2) / 8
    assert lr_at(2, c) == pytest.approx(1e-3)
    assert lr_at(6, c) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(6, c) == pytest.approx(0.55e-3)
    assert lr_at(10, c) == pytest.approx(1e-4)
    assert lr_at(50, c) == pytest.approx(1e-4)


def test_linear_and_constant_schedules():
    assert lr_at(6, cfg(lr_schedule="linear")) == pytest.approx(1e-3 - 0.9e-3 * 0.5)
    assert lr_at(10, cfg(lr_schedule="linear")) == pytest.approx(1e-4)
    assert lr_at(9, cfg(lr_schedule="constant")) == pytest.approx(1e-3)


def test_no_warmup_starts_at_peak():
    assert lr_at(0, cfg(warmup_steps=0)) == pytest.approx(1e-3)


def test_scheduler_drives_the_optimizer_lr():
    c = cfg()
    param = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([param], lr=c.lr)
    sched = build_scheduler(opt, c)
    seen = []
    for _ in range(c.steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, c) for s in range(c.steps)])


def test_weight_decay_on_matrices_only():
    model = build_model(model_preset("tiny"))
    model.to_empty(device="cpu")
    opt = build_optimizer([model], cfg(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])
    # 2 norms per layer x 2 layers + final norm = 5 vectors of 64.
    assert [tuple(p.shape) for p in plain["params"]] == [(64,)] * 5
    assert decayed["betas"] == (0.9, 0.95) and decayed["lr"] == 1e-3


def test_adamw_runs_the_fused_kernel_on_cpu_else_foreach():
    model = build_model(model_preset("tiny"))
    model.to_empty(device="cpu")
    opt = build_optimizer([model], cfg(weight_decay=0.1))
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    on_meta = build_optimizer([build_model(model_preset("tiny"))], cfg(weight_decay=0.1))
    assert on_meta.defaults["foreach"] is True and not on_meta.defaults["fused"]
