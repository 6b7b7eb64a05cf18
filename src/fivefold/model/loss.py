"""Token-level cross entropy for language modelling."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross entropy of logits [B, T, V] against labels [B, T], computed in fp32.

    reduction="mean": mean over tokens whose label != -100 (NaN if there are none, as in torch);
    reduction="sum": their sum (for callers that divide by a global token count themselves).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
