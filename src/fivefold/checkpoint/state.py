"""The non-tensor training state of a checkpoint, as JSON (never pickled objects).

Details: docs/checkpoints.md.
"""

from __future__ import annotations

import base64
import binascii
import json
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.errors import CheckpointError
from fivefold.specs.model import ModelSpec

# torch is imported inside the functions that use it: the launcher's pre-start check reads a
# checkpoint's state without torch (fivefold.train.prestart).

STATE_FORMAT = "fivefold-state-v1"
STATE_FILE = "state.json"
# Fields of the model spec that do not change the tensors a checkpoint holds.
_SPEC_FIELDS_IGNORED = ("name", "notes", "doc_len")


@dataclass
class TrainingState:
    """Everything but tensors. `rng` holds one entry per saving rank (index = global rank)."""

    step: int = 0  # optimizer steps completed
    model_spec: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # ranks that wrote the checkpoint
    contents: list[str] = field(default_factory=lambda: ["model", "optimizer"])
    scheduler: dict[str, Any] | None = None
    sampler: dict[str, Any] | None = None
    rng: list[dict[str, Any]] = field(default_factory=list)
    optimizer_hparams: list[dict[str, Any]] = field(default_factory=list)  # groups, see dcp_io
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the last loss
    format: str = STATE_FORMAT

    @property
    def has_optimizer(self) -> bool:
        return "optimizer" in self.contents

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True, allow_nan=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "state.json") -> TrainingState:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(
                f"{where} is not valid JSON ({err}); the checkpoint is damaged. Run "
                "`fivefold ckpt verify` on its directory and resume from an older checkpoint."
            ) from None
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(
                f"{where} has format {found!r}, expected {STATE_FORMAT!r}; it was not written "
                "by this version of fivefold's checkpointer."
            )
        problems = _field_problems(data)
        if problems:
            raise CheckpointError(
                f"{where} is damaged: {'; '.join(problems)}. Run `fivefold ckpt verify` on its "
                "directory and resume from an older checkpoint (or start with --fresh)."
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


# field -> (accepted JSON types, what it must be); None is accepted only where listed.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "step": ((int,), "a whole number >= 0"),
    "world_size": ((int,), "a whole number >= 1"),
    "model_spec": ((dict,), "a table"),
    "plan": ((dict,), "a table"),
    "contents": ((list,), "a list of names"),
    "scheduler": ((dict, type(None)), "a table or null"),
    "sampler": ((dict, type(None)), "a table or null"),
    "rng": ((list,), "a list of RNG states"),
    "optimizer_hparams": ((list,), "a list"),
    "extra": ((dict,), "a table"),
}


def _field_problems(data: dict[str, Any]) -> list[str]:
    """What in a parsed state.json has the wrong type or an impossible value."""
    out = []
    for name, (types, what) in _FIELD_TYPES.items():
        if name not in data:
            continue
        value = data[name]
        bad_type = isinstance(value, bool) or not isinstance(value, types)
        if bad_type or (name == "step" and value < 0) or (name == "world_size" and value < 1):
            out.append(f"{name} = {value!r} (expected {what})")
    if isinstance(data.get("rng"), list) and not all(isinstance(r, dict) for r in data["rng"]):
        out.append("rng holds an entry that is not an RNG state table")
    return out


def write_state(directory: Path, state: TrainingState) -> Path:
    path = Path(directory) / STATE_FILE
    path.write_text(state.to_json())
    return path


def read_state(directory: Path) -> TrainingState:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has no {STATE_FILE}; it is incomplete or not a "
            "fivefold checkpoint directory (a step_<n> directory under <run_dir>/ckpt)."
        )
    return TrainingState.from_json(path.read_text(), str(path))


# ---- model spec compatibility --------------------------------------------------------------
def spec_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`model.<field> = <current> (checkpoint: <saved>)` for every field that differs. A field
    a checkpoint predates (absent from it) counts as its default."""
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    keys = sorted((set(saved) | set(current)) - set(_SPEC_FIELDS_IGNORED))
    return [
        f"model.{key} = {current.get(key)!r} (checkpoint: {saved.get(key)!r})"
        for key in keys
        if current.get(key, defaults.get(key)) != saved.get(key, defaults.get(key))
    ]


def check_model_spec(state: TrainingState, current: dict[str, Any], where: Path | str) -> None:
    """CheckpointError naming every differing field unless the checkpoint's model is `current`."""
    differ = spec_mismatches(state.model_spec, current)
    if differ:
        raise CheckpointError(
            f"checkpoint {str(where)!r} holds a different model: {'; '.join(differ)}. Use the "
            "recipe it was trained with (its model section is in the checkpoint's state.json), "
            "or start a new run in another train.run_dir."
        )


# ---- RNG -------------------------------------------------------------------------------------
def _b64(tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _from_b64(text: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This process's torch (CPU, CUDA), Python and NumPy global RNG states, JSON-ready."""
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state(torch.cuda.current_device()))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global RNGs from a `capture_rng` dict (CUDA onto this process's current GPU, if
    saved and available); CheckpointError if the saved states are not ones these generators
    accept."""
    try:
        _restore_rng(state)
    except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as err:
        raise CheckpointError(
            f"the checkpoint's saved RNG state is damaged ({type(err).__name__}: {err}); resume "
            "from an older checkpoint (`fivefold ckpt verify` lists them) or start with --fresh."
        ) from None


def _restore_rng(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(_from_b64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state.get("cuda") and torch.cuda.is_available():
        device = torch.cuda.current_device()
        saved = state["cuda"]
        if isinstance(saved, list):  # older checkpoints: every visible GPU's state, by index
            saved = saved[device % len(saved)]
        torch.cuda.set_rng_state(_from_b64(saved), device)


def rng_for_rank(state: TrainingState, rank: int) -> dict[str, Any] | None:
    """The saved RNG state rank `rank` restores: its own, or rank mod the saved world size."""
    if not state.rng:
        return None
    return state.rng[rank % len(state.rng)]
