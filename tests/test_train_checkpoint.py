"""Plain-torch checkpoints: atomic, weights_only-loadable, pruned, and checked on load."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from fivefold.errors import CheckpointError
from fivefold.train import checkpoint as ckpt


def make_state(step: int) -> ckpt.TrainState:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return ckpt.TrainState(
        step=step,
        model=[model.state_dict()],
        optimizer=opt.state_dict(),
        scheduler={"last_epoch": step, "base_lrs": [0.1]},
        sampler={"consumed": 8 * step, "num_samples": 100, "seed": 0, "shuffle": True},
        rng=ckpt.capture_rng(),
        model_spec={"name": "m", "layers": 2},
        plan={"tp": 1},
        extra={"loss": 1.5},
    )


def test_save_is_atomic_and_loads_with_weights_only(tmp_path):
    state = make_state(3)
    directory = ckpt.save_checkpoint(tmp_path, state)
    assert directory == tmp_path / "ckpt" / "step_3"
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json", "rank_00000.pt"]
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "ckpt").iterdir())
    raw = torch.load(directory / "rank_00000.pt", weights_only=True)  # raises on any pickle
    assert raw["step"] == 3 and raw["sampler"]["consumed"] == 24
    loaded = ckpt.load_checkpoint(directory)
    for key, value in state.model[0].items():
        assert torch.equal(loaded.model[0][key], value)
    assert loaded.optimizer["state"][0]["step"] == 1
    assert json.loads((directory / "meta.json").read_text())["step"] == 3


def test_rng_state_round_trips(tmp_path):
    ckpt.save_checkpoint(tmp_path, make_state(1))
    expected = (torch.rand(3), random.random(), np.random.rand())
    ckpt.restore_rng(ckpt.load_checkpoint(tmp_path / "ckpt" / "step_1").rng)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def test_keep_prunes_old_checkpoints_and_latest_is_newest(tmp_path):
    for step in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, make_state(step), keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "ckpt" / "step_6"


def test_leftover_temporary_directory_is_not_a_checkpoint(tmp_path):
    ckpt.save_checkpoint(tmp_path, make_state(2))
    (tmp_path / "ckpt" / ".tmp_step_4").mkdir()  # a crash while saving step 4
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "ckpt" / "step_2"


def test_corrupt_file_is_a_checkpoint_error(tmp_path):
    directory = ckpt.save_checkpoint(tmp_path, make_state(1))
    (directory / "rank_00000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        ckpt.load_checkpoint(directory)


def test_missing_rank_file_is_a_checkpoint_error(tmp_path):
    directory = ckpt.save_checkpoint(tmp_path, make_state(1))
    with pytest.raises(CheckpointError, match="no file for rank 1"):
        ckpt.load_checkpoint(directory, rank=1)


def test_different_model_is_refused(tmp_path):
    state = make_state(1)
    with pytest.raises(CheckpointError, match=r"model.layers = 4 \(checkpoint: 2\)"):
        ckpt.check_compatible(state, {"name": "m", "layers": 4}, tmp_path)
    ckpt.check_compatible(state, {"name": "m", "layers": 2}, tmp_path)  # same model: fine
