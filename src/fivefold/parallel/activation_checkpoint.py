"""Activation checkpointing (recompute) per transformer block, keeping every parameter name.

`plan.recompute`:
- "none": keep every activation.
- "full": each block stores only its input; its whole forward is re-run during backward.
- "selective": only the attention core (QK^T, softmax, AV) is re-run, so the T x T score
  activations are never stored while the projections and MLP keep theirs (Korthikanti et al.
  2022's selective recompute).

Both wrap a module's `forward` in `torch.utils.checkpoint.checkpoint` (non-reentrant) instead of
inserting wrapper modules, so parameter FQNs, state-dict keys and the addresses parallel code
uses (`model.layers["0"].attention.core`) stay what they were. The recomputation is the same
arithmetic in the same order, so losses and gradients equal the no-recompute run exactly.

The single-process runtime applies it to the whole model; the parallel runtime applies it after
TP, EP and CP (so a context-parallel core is what selective recompute re-runs, its ring
collectives included) and before FSDP/DDP (whose hooks then gather the parameters around the
recomputation).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.specs.geometry import RECOMPUTE_POLICIES

_WRAPPED = "_fivefold_recompute"


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Make `module`'s forward recompute in backward instead of storing activations (idempotent)."""
    if getattr(module, _WRAPPED, False):
        return
    module.forward = functools.partial(_checkpointed_forward, module.forward)  # type: ignore[method-assign]
    setattr(module, _WRAPPED, True)


def apply_recompute(model: nn.Module, policy: str) -> int:
    """Apply `policy` to every block in `model.layers` (a Transformer or a pipeline chunk);
    returns how many modules were wrapped."""
    assert policy in RECOMPUTE_POLICIES, policy  # ParallelPlan.problems names the choices
    if policy == "none":
        return 0
    wrapped = 0
    for block in model.layers.values():
        target = block if policy == "full" else block.attention.core
        checkpoint_module(target)
        wrapped += 1
    return wrapped


def remove_recompute(model: nn.Module) -> int:
    """Undo `apply_recompute` on every module of `model` (each stores its activations again);
    returns how many modules were unwrapped. `fivefold tune` swaps policies on one model."""
    unwrapped = 0
    for module in model.modules():
        if getattr(module, _WRAPPED, False):
            del module.forward  # the instance attribute; the class's forward shows again
            delattr(module, _WRAPPED)
            unwrapped += 1
    return unwrapped
