"""fivefold.checkpoint: distributed checkpoints that survive failures and reshard.

ckpt = Checkpointer(run_dir / "ckpt", keep=2, async_save=False)     # every rank, collectively
ckpt.save(step, runtime.model_parts, optimizer, model_spec=..., plan=..., scheduler=...,
          sampler=..., extra={"loss": loss})
choice = ckpt.select()               # newest checkpoint whose files match its manifest
state = ckpt.load(choice.path, runtime.model_parts, optimizer, model_spec=..., scheduler=...,
                  sampler=...)       # any layout and world size; returns the TrainingState

Formats: tensors through torch.distributed.checkpoint (global FQN keys), everything else in
state.json, sizes and SHA-256 in manifest.json; see docs/checkpoints.md. Names are imported
lazily so `fivefold.checkpoint.manifest` (used by `fivefold ckpt`) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "checkpointer",
    "load_checkpoint": "checkpointer",
    "save_checkpoint": "checkpointer",
    "Selection": "manifest",
    "Verification": "manifest",
    "list_checkpoints": "manifest",
    "newest_valid": "manifest",
    "resolve_root": "manifest",
    "verify_checkpoint": "manifest",
    "TrainingState": "state",
    "check_model_spec": "state",
    "spec_mismatches": "state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fivefold.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fivefold.checkpoint.{_EXPORTS[name]}"), name)
