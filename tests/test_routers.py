"""DeepSeek-V3's router (`fivefold.model.routers`) by hand: sigmoid scores, the score-correction
bias choosing but not weighting, group-limited top-k, routed scaling; the auxiliary-loss-free
balancing of the bias, counted only in a training forward (not in a recompute or evaluation),
and run by the training loop after each optimizer step. Its equality with transformers'
DeepseekV3TopkRouter over a whole model is in tests/checkpoint/test_hf_deepseek.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from fivefold.model.routers import (
    RouterSettings,
    SigmoidRouting,
    balance_router_biases,
    route_sigmoid,
)
from fivefold.specs.model import ModelSpec
from fivefold.train.entry import load_run
from fivefold.train.runtime import LocalRuntime
from fivefold.train.start import train

GROUPED = RouterSettings("sigmoid", groups=2, top_groups=1, scaling=2.5)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_group_limited_choice_and_gates_by_hand():
    # scores: group 0 = (0.9, 0.1) sums its best two to 1.0, group 1 = (0.6, 0.5) to 1.1:
    # group 1 wins though expert 0 is the best expert; top-2 within it: experts 2 and 3.
    logits = torch.tensor([[_logit(0.9), _logit(0.1), _logit(0.6), _logit(0.5)]])
    routing = route_sigmoid(logits, torch.zeros(4), 2, GROUPED)
    assert sorted(routing.expert_indices[0].tolist()) == [2, 3]
    gates = dict(zip(routing.expert_indices[0].tolist(), routing.gates[0].tolist(), strict=True))
    assert gates[2] == pytest.approx(2.5 * 0.6 / 1.1) and gates[3] == pytest.approx(2.5 * 0.5 / 1.1)
    # a bias of +0.2 on expert 1 makes group 0 score 1.2: experts 0 and 1 are chosen, and
    # weighted by their scores without the bias
    routing = route_sigmoid(logits, torch.tensor([0.0, 0.2, 0.0, 0.0]), 2, GROUPED)
    gates = dict(zip(routing.expert_indices[0].tolist(), routing.gates[0].tolist(), strict=True))
    assert gates == pytest.approx({0: 2.5 * 0.9 / 1.0, 1: 2.5 * 0.1 / 1.0})
    assert routing.probs[0].tolist() == pytest.approx([0.9 / 2.1, 0.1 / 2.1, 0.6 / 2.1, 0.5 / 2.1])
    # norm_topk_prob = false: the chosen scores as they are, times the routed scaling
    routing = route_sigmoid(logits, torch.zeros(4), 2, GROUPED, norm_topk=False)
    gates = dict(zip(routing.expert_indices[0].tolist(), routing.gates[0].tolist(), strict=True))
    assert gates == pytest.approx({2: 2.5 * 0.6, 3: 2.5 * 0.5})


def test_balancing_moves_the_bias_by_the_sign_of_the_load_error():
    routing = SigmoidRouting(4, 1, RouterSettings("sigmoid", bias_update_speed=0.01))
    # tokens choosing experts 0, 0, 0, 1, 3, 3, 3, 3: loads (3, 1, 0, 4), mean 2
    logits = torch.full((8, 4), -5.0)
    for token, expert in enumerate([0, 0, 0, 1, 3, 3, 3, 3]):
        logits[token, expert] = 5.0
    routing(logits)
    routing.eval()
    routing(logits)  # an evaluation does not count
    routing.train()
    routing.counts_load = False
    routing(logits)  # nor does a recompute
    assert routing.expert_load.tolist() == [3, 1, 0, 4]
    balance_router_biases([routing])
    assert routing.score_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, -0.01])
    assert routing.expert_load.tolist() == [0, 0, 0, 0]


def test_router_settings_refused_by_name():
    moe = {"experts": 8, "top_k": 2, "expert_ffn": 32}
    for changes, field in (
        ({"router_score": "relu"}, "model.router_score"),
        ({"router_groups": 3, "router_top_groups": 1}, "model.router_groups"),
        ({"router_groups": 4, "router_top_groups": 5}, "model.router_top_groups"),
        ({"routed_scaling": 0.0}, "model.routed_scaling"),
        ({"router_bias_update_speed": 0.01}, "model.router_bias_update_speed"),  # softmax
    ):
        problems = ModelSpec(**moe, **changes).problems()
        assert len(problems) == 1 and field in problems[0], (changes, problems)
    assert "router_* settings" in ModelSpec(router_score="sigmoid").problems()[0]  # dense


def test_the_training_loop_balances_after_each_step(tmp_path):
    configs = Path(__file__).resolve().parents[1] / "configs"
    overrides = [
        f"train.runs_dir={str(tmp_path)!r}",
        "train.name='ds'",
        "train.progress=false",
        "train.tensorboard=false",
        "train.steps=2",
        "train.warmup_steps=0",
        "model.preset='tiny-moe'",
        "model.seq_len=16",
        "model.layers=1",
        "model.router_score='sigmoid'",
        "model.router_bias_update_speed=0.01",
        "plan.micro_batch=2",
    ]
    cfg = load_run(configs / "tiny-cpu.toml", overrides, world_size=1)
    runtime = LocalRuntime(cfg.recipe, cfg.train)
    train(cfg, runtime=runtime, console=Console(quiet=True))
    for moe in runtime.model.moe_layers():
        steps = moe.routing.score_bias / 0.01  # each step moved each bias by -1, 0 or +1
        assert torch.allclose(steps, steps.round(), atol=1e-4)
        assert steps.abs().max() >= 1 and steps.abs().max() <= 2
        assert moe.routing.expert_load.sum() == 0  # reset after the last step


def test_a_pipeline_stage_counts_loads_only_in_its_recorded_forwards():
    """torch's shape-inference forward calls the stage's module outside the recorded
    micro-batch forwards, on placeholder (uninitialised) inputs: it must not count."""
    from fivefold.parallel.pipeline import _AuxLossCollector
    from tiny_models import make

    spec = ModelSpec(
        layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, experts=4, top_k=2,
        expert_ffn=16, router_score="sigmoid", router_bias_update_speed=0.01,
    )  # fmt: skip
    model = make(spec)
    collector = _AuxLossCollector()
    model.register_forward_pre_hook(collector.before_forward)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    model(tokens)  # as shape inference calls it
    (moe,) = model.moe_layers()
    assert moe.routing.expert_load.sum() == 0
    with collector.recording():
        model(tokens)
    assert moe.routing.expert_load.sum() == 2 * 8 * 2  # tokens x top_k
    assert not moe.routing.counts_load  # cleared after the forward: a recompute counts nothing
