"""Activation checkpointing per block for parallelised models: none, selective or full.

The same wrapping the single-process runtime uses (`fivefold.train.recompute`): a block's (full)
or its attention core's (selective) `forward` runs under non-reentrant `torch.utils.checkpoint`,
so parameter names are unchanged and recompute changes no number. In the parallel runtime it is
applied after TP, EP and CP (so a context-parallel core is what selective recompute re-runs, its
ring collectives included) and before FSDP/DDP (whose hooks then gather the parameters around
the recomputation).
"""

from __future__ import annotations

from torch import nn

from fivefold.spec.model import RECOMPUTE_POLICIES


def apply_activation_checkpointing(model: nn.Module, policy: str) -> int:
    """Wrap every block of `model` (a Transformer or a pipeline chunk); returns how many modules."""
    from fivefold.train.recompute import apply_recompute

    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute policy must be one of {RECOMPUTE_POLICIES}, got {policy!r}")
    return apply_recompute(model, policy)
