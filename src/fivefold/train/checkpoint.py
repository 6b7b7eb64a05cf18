"""Checkpoints in plain torch format: `<run_dir>/ckpt/step_<n>/rank_<r>.pt` plus `meta.json`.

Each rank saves what it owns (its model parts, optimizer, scheduler, sampler and RNG states, the
step, the model spec and the plan) as tensors and primitive Python values only, so
`torch.load(..., weights_only=True)` reads it back. A checkpoint is written into a temporary
directory and renamed into place, so a `step_<n>` directory is always complete: a crash while
saving leaves the previous checkpoint as the newest. All checkpoint I/O lives in this module; a
later version replaces the format with torch.distributed.checkpoint (DCP) for resharding.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fivefold.errors import CheckpointError

FORMAT = "fivefold-torch-v1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainState:
    """Everything a rank restores to continue a run bit-identically."""

    step: int  # optimizer steps completed
    model: list[dict[str, torch.Tensor]]  # one state dict per model part
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    sampler: dict[str, Any]
    rng: dict[str, Any]
    model_spec: dict[str, Any]
    plan: dict[str, Any]
    extra: dict[str, Any]  # e.g. the last loss, tokens seen


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "ckpt"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step}"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}.pt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, directory), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


# ---- RNG ----------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """torch (CPU and CUDA), Python and NumPy global RNG states as tensors and primitives."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save ---------------------------------------------------------------------------------------
def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(
    run_dir: Path, state: TrainState, rank: int = 0, world_size: int = 1, keep: int = 0
) -> Path:
    """Write `state` as `<run_dir>/ckpt/step_<n>/rank_<r>.pt` atomically; returns the directory.

    Every rank calls this (collectively when world_size > 1); rank 0 prepares the temporary
    directory, publishes it with a rename and prunes all but the newest `keep` (0 keeps all).
    """
    final = step_dir(run_dir, state.step)
    tmp = final.with_name(f".tmp_{final.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    payload = {
        "format": FORMAT,
        "step": state.step,
        "rank": rank,
        "world_size": world_size,
        "model": state.model,
        "optimizer": state.optimizer,
        "scheduler": state.scheduler,
        "sampler": state.sampler,
        "rng": state.rng,
        "model_spec": state.model_spec,
        "plan": state.plan,
        "extra": state.extra,
    }
    try:
        torch.save(payload, rank_file(tmp, rank))
    except OSError as err:
        raise CheckpointError(
            f"cannot write checkpoint {str(tmp)!r} ({err.strerror}); check free disk space and "
            "permissions of train.run_dir."
        ) from None
    _barrier()
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": state.step,
            "world_size": world_size,
            "model_spec": state.model_spec,
            "plan": state.plan,
            "extra": state.extra,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # re-saving the same step (e.g. a resumed run that did nothing)
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep > 0:
            for _, old in list_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


# ---- load ---------------------------------------------------------------------------------------
def load_checkpoint(
    directory: Path, rank: int = 0, device: str | torch.device = "cpu"
) -> TrainState:
    """Read one rank's state from a `step_<n>` directory; CheckpointError if it is unusable."""
    directory = Path(directory)
    path = rank_file(directory, rank)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has no file for rank {rank} ({path.name}); it was "
            "written by a different number of processes or is incomplete. Resume with the "
            "world size it was saved with, or start a new run (train.resume = false)."
        )
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # unpickling errors have many types; all mean "unreadable"
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read ({type(err).__name__}: {err}); it is "
            "corrupt or not a fivefold checkpoint. Delete that step directory to resume from an "
            "older one."
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is not in the {FORMAT} format; it was not written "
            "by this version of fivefold."
        )
    return TrainState(
        step=int(payload["step"]),
        model=payload["model"],
        optimizer=payload["optimizer"],
        scheduler=payload["scheduler"],
        sampler=payload["sampler"],
        rng=payload["rng"],
        model_spec=payload["model_spec"],
        plan=payload["plan"],
        extra=payload.get("extra", {}),
    )


def check_compatible(state: TrainState, model_spec: dict[str, Any], where: Path) -> None:
    """The checkpoint's model must be the recipe's model; CheckpointError names what differs."""
    differ = [
        f"model.{key} = {model_spec.get(key)!r} (checkpoint: {state.model_spec.get(key)!r})"
        for key in sorted(set(model_spec) | set(state.model_spec))
        if model_spec.get(key) != state.model_spec.get(key)
    ]
    if differ:
        raise CheckpointError(
            f"checkpoint {str(where)!r} holds a different model: {'; '.join(differ)}. Use the "
            "recipe it was trained with, or a new train.name to start a fresh run."
        )
