"""The optimizers fivefold trains with and the plan settings each cannot honour (one rule for
`[train] optimizer`, `[planner] optimizer` and `fivefold plan --optimizer`).

"adamw": AdamW on every parameter. "muon": Muon (one fp32 momentum buffer, Newton-Schulz on
whole matrices) on the blocks' 2-D matrices, AdamW on embeddings, head, norms, biases and
stacked expert weights (`fivefold.train.muon`, docs/internals.md).
"""

from __future__ import annotations

from typing import Any

OPTIMIZERS = ("adamw", "muon")


def optimizer_plan_problems(optimizer: str, plan: Any, field: str = "train.optimizer") -> list[str]:
    """The plan's settings `optimizer` cannot honour: torchao's low-bit states are AdamW's, and
    host offload would run Newton-Schulz on host copies the whole-matrix gather cannot reach.
    `field`: how the choice was spelled (train.optimizer, planner.optimizer, --optimizer)."""
    if optimizer != "muon":
        return []
    out = []
    if plan.optimizer_states != "fp32":
        out.append(
            f"plan.optimizer_states = {plan.optimizer_states!r} with {field} = 'muon': "
            "low-bit states are torchao's AdamW; set plan.optimizer_states = 'fp32' (Muon keeps "
            f"one fp32 buffer, half of AdamW's) or {field} = 'adamw'."
        )
    if plan.offload != "none":
        out.append(
            f"plan.offload = {plan.offload!r} with {field} = 'muon': Muon's step gathers "
            f"whole matrices on the device; set plan.offload = 'none' or {field} = 'adamw'."
        )
    return out
