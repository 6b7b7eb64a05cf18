"""The global batch as the plan runs it: micro_batch x dp x grad_accum sequences per step.

The one rule for deriving `plan.grad_accum` from a batch asked for (the planner's search target,
`plan estimate --global-batch`, the explorer, the data loader): the nearest whole number of
micro-batches, at least one, accepted when it lands within a tolerance of the batch (0 for a
batch stated exactly).
"""

from __future__ import annotations


def nearest_grad_accum(sequences: float, micro_batch: int, dp: int) -> int:
    """The whole number of micro-batches (>= 1) whose batch is nearest `sequences`."""
    return max(1, round(sequences / (micro_batch * dp)))


def grad_accum_for(
    sequences: float, micro_batch: int, dp: int, tolerance: float = 0.0
) -> int | None:
    """`nearest_grad_accum` when micro_batch x dp x it is within `tolerance` (a fraction) of
    `sequences`, else None."""
    accum = nearest_grad_accum(sequences, micro_batch, dp)
    if abs(micro_batch * dp * accum - sequences) <= tolerance * sequences + 1e-9:
        return accum
    return None


def grad_accum_problem(sequences: float, micro_batch: int, dp: int, field: str) -> str:
    """Why `field` (a batch of `sequences`) has no whole number of micro-batches of
    micro_batch x dp sequences, with the two nearest batches that have."""
    per_step = micro_batch * dp
    low = max(per_step, int(sequences // per_step) * per_step)
    return (
        f"{field} = {sequences:g} sequences is not a whole number of micro-batches of "
        f"micro_batch x dp = {micro_batch} x {dp} = {per_step}; choose a multiple such as {low} "
        f"or {low + per_step}, or set grad_accum, the micro-batch or the DP degree."
    )
