"""A damaged `state.json` (wrong types, impossible values, garbage RNG states) is one
CheckpointError naming the field, never a traceback deep inside the resume (#13)."""

from __future__ import annotations

import json

import pytest
import torch

from fivefold.checkpoint.state import TrainingState, capture_rng, restore_rng
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
