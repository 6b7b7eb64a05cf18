"""A damaged `state.json` (wrong types, impossible values, garbage RNG states) is one
CheckpointError naming the field, never a traceback deep inside the resume."""

from __future__ import annotations

import json

import pytest
import torch

from fivefold.checkpoint.state import TrainingState, _b64, capture_rng, restore_rng
from fivefold.errors import CheckpointError


def _text(**changes) -> str:
    data = json.loads(TrainingState(step=3, rng=[capture_rng()]).to_json())
    return json.dumps({**data, **changes})


def test_a_valid_state_round_trips():
    state = TrainingState.from_json(_text())
    assert state.step == 3 and len(state.rng) == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"step": "7"}, "step = '7' (expected a whole number >= 0)"),
        ({"step": -1}, "step = -1"),
        ({"step": True}, "step = True"),
        ({"world_size": 0}, "world_size = 0"),
        ({"plan": [1, 2]}, "plan = [1, 2] (expected a table)"),
        ({"rng": "garbage"}, "rng = 'garbage'"),
        ({"rng": [1, 2]}, "rng holds an entry that is not an RNG state table"),
    ],
)
def test_wrong_types_are_named(change, named):
    with pytest.raises(CheckpointError, match="is damaged") as err:
        TrainingState.from_json(_text(**change))
    assert named in str(err.value)


@pytest.mark.parametrize(
    "corrupt",
    [
        {"torch": "not base64!"},
        {"torch": "AAAA"},  # valid base64, wrong size for the generator
        {"python": "garbage"},
        {"numpy": [1]},
    ],
)
def test_garbage_rng_states_are_a_checkpoint_error(corrupt):
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="saved RNG state is damaged"):
        restore_rng({**capture_rng(), **corrupt})
    torch.set_rng_state(before)


class FakeCudaRng:
    """torch.cuda's RNG calls on a machine with `count` GPUs, this process on `device`."""

    def __init__(self, monkeypatch, count: int, device: int):
        self.count, self.device, self.set_calls = count, device, []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(cuda, "get_rng_state", self.get)
        monkeypatch.setattr(cuda, "set_rng_state", self.set)
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(count)])

    def get(self, device="cuda"):
        index = device if isinstance(device, int) else self.device
        return torch.full((16,), 10 + index, dtype=torch.uint8)  # each GPU's own state

    def set(self, state, device="cuda"):
        index = device if isinstance(device, int) else self.device
        if index >= self.count:  # what torch does for a GPU this machine lacks
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.set_calls.append((index, int(state[0])))


def test_each_rank_saves_the_rng_of_its_own_gpu_only(monkeypatch):
    fake = FakeCudaRng(monkeypatch, count=8, device=3)
    saved = capture_rng()["cuda"]
    assert isinstance(saved, str)  # one GPU's state, not the node's eight
    fake.device = 0
    restore_rng({**capture_rng(), "cuda": saved})
    assert fake.set_calls == [(0, 13)]  # rank's own state onto its own GPU


def test_resuming_on_fewer_gpus_restores_by_rank(monkeypatch):
    """Saved by 8 ranks on an 8-GPU node, resumed by 2 ranks on a 2-GPU machine: each rank
    takes rank r mod 8's state and puts it on its own GPU (once reported as 'damaged')."""
    from fivefold.checkpoint.state import rng_for_rank

    fake = FakeCudaRng(monkeypatch, count=8, device=0)
    per_rank = []
    for rank in range(8):
        fake.device = rank
        per_rank.append(capture_rng())
    state = TrainingState(step=5, rng=per_rank)
    fake.count = 2
    for rank in range(2):
        fake.device, fake.set_calls = rank, []
        restore_rng(rng_for_rank(state, rank))
        assert fake.set_calls == [(rank, 10 + rank)]
    assert rng_for_rank(state, 9) is per_rank[1]  # more ranks than saved: r mod 8


def test_older_checkpoints_with_every_gpus_state_still_resume_on_one_gpu(monkeypatch):
    fake = FakeCudaRng(monkeypatch, count=8, device=0)
    older = {**capture_rng(), "cuda": [_b64(fake.get(i)) for i in range(8)]}
    fake.count, fake.device = 1, 0
    restore_rng(older)  # torch.cuda.set_rng_state_all would reach GPU 7: invalid ordinal
    assert fake.set_calls == [(0, 10)]
