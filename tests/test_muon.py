"""`train.optimizer = "muon"` in one process: the split, the update against torch.optim.Muon,
the fallback, the state, and the settings it refuses.

The reference is torch's own pair of optimizers as its documentation pairs them (Muon over the
2-D hidden matrices, AdamW over the rest), stepped on a copy of the same model with the same
gradients; fivefold's one optimizer must give bit-identical parameters after three steps, with
torch's Newton-Schulz and with its own copy (what a torch without torch.optim.Muon runs).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fivefold.train.muon as muon_module
from fivefold.errors import ConfigError
from fivefold.specs.recipe import recipe_from_dict
from fivefold.train.config import TrainConfig, parse_train_config
from fivefold.train.optim import build_optimizer, muon_matrices
from tiny_models import TINY, make

CFG = TrainConfig(optimizer="muon", lr=2e-3, weight_decay=0.1)


def _model():
    return make(TINY, seed=0)


def _gradients(model, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=g)


def _torch_pair(model):
    """torch.optim.Muon over the blocks' matrices + torch AdamW over the rest (the reference)."""
    names = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    hidden = [p for n, p in model.named_parameters() if n in names]
    rest = [p for n, p in model.named_parameters() if n not in names]
    muon = torch.optim.Muon(
        hidden, lr=CFG.lr, weight_decay=CFG.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    groups = [
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": CFG.weight_decay},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=CFG.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return muon, adamw


def _run_both(monkeypatch, own_newton_schulz: bool):
    if own_newton_schulz:
        monkeypatch.setattr(muon_module, "has", lambda key: False)
    ours_model = _model()
    ref_model = copy.deepcopy(ours_model)
    ours = build_optimizer([ours_model], CFG)
    ref = _torch_pair(ref_model)
    for step in range(3):
        _gradients(ours_model, step)
        _gradients(ref_model, step)
        ours.step()
        for opt in ref:
            opt.step()
    return ours_model, ref_model, ours


@pytest.mark.parametrize("own", [False, True], ids=["torch-newton-schulz", "fallback"])
def test_update_is_torch_muon_bit_for_bit(monkeypatch, own):
    ours_model, ref_model, _ = _run_both(monkeypatch, own)
    start = _model()
    for (name, a), (_, b), (_, s) in zip(
        ours_model.named_parameters(),
        ref_model.named_parameters(),
        start.named_parameters(),
        strict=True,
    ):
        assert not torch.equal(a, s), f"{name} did not move"
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max()}"


def test_split_and_state(monkeypatch):
    model, _, optimizer = _run_both(monkeypatch, False)
    hidden = {id(p) for p in muon_matrices([model])}
    names = {n for n, p in model.named_parameters() if id(p) in hidden}
    # 2 layers x (wq, wk, wv, wo, w1, w2, w3); never the embedding or the head
    assert len(names) == 14 and all(n.startswith("layers.") for n in names)
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        keys = {"momentum_buffer"} if id(param) in hidden else {"step", "exp_avg", "exp_avg_sq"}
        assert set(state) == keys, name
    # state_dict round trip keeps both kinds of groups and re-links the inner AdamW
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    assert optimizer.adamw.state is optimizer.state
    assert [g["muon"] for g in optimizer.param_groups] == [False, False, True]
    assert optimizer.param_groups[2]["lr"] == CFG.lr


def test_muon_lr_is_its_own_group_peak():
    cfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, muon_adjust_lr="original")
    optimizer = build_optimizer([_model()], cfg)
    lrs = [(g["muon"], g["lr"]) for g in optimizer.param_groups]
    assert lrs == [(False, 1e-3), (False, 1e-3), (True, 0.02)]
    assert optimizer.param_groups[2]["adjust_lr_fn"] == "original"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("optimizer", "sgd"),
        ("muon_momentum", 1.0),
        ("muon_ns_steps", 0),
        ("muon_adjust_lr", "spectral"),
        ("muon_lr", -1.0),
        ("muon_ns_dtype", "fp16"),
    ],
)
def test_bad_muon_settings_name_the_field(field, value):
    problems = TrainConfig(**{"optimizer": "muon", field: value}).problems()
    assert len(problems) == 1 and problems[0].startswith(f"train.{field} = ")


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        ({"optimizer_states": "8bit"}, "plan.optimizer_states = '8bit'"),
        ({"offload": "optimizer"}, "plan.offload = 'optimizer'"),
    ],
)
def test_levers_muon_cannot_honour_are_refused(tmp_path, plan, field):
    recipe = recipe_from_dict(
        {
            "model": {"preset": "tiny"},
            "plan": plan,
            "train": {"optimizer": "muon", "runs_dir": str(tmp_path)},
        },
        default_world=1,
    )
    with pytest.raises(ConfigError) as err:
        parse_train_config(recipe)
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(field) and "train.optimizer" in err.value.problems[0]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_state_bytes_are_the_planners(optimizer):
    """The runtime's optimizer state (without AdamW's step counters) is the planner's
    optimizer tenant: Muon's one buffer per block matrix, AdamW's two for the rest."""
    from fivefold.planner.memory.model_states import chunk_state
    from fivefold.specs import ParallelPlan

    model = _model()
    built = build_optimizer([model], TrainConfig(optimizer=optimizer))
    _gradients(model, 0)
    built.step()
    held = sum(
        t.numel() * t.element_size()
        for state in built.state.values()
        for key, t in state.items()
        if key != "step"
    )
    plan = ParallelPlan(precision="fp32")
    predicted = chunk_state(TINY, plan, [TINY.layers], 0, optimizer=optimizer)
    assert held == predicted[0].optimizer
