"""Held-out losses: one over the run's held-out split, and for a mixture one per source.

A mixture's sources each hold out their own tail (`fivefold.train.inputs.SourceData.val`); the
run's eval loss is then the mixture-weighted mean of the sources' losses (nats per token), so it
weighs the sources as training does.
"""

from __future__ import annotations

from typing import Any

from fivefold.train.inputs import TrainData


def held_out_losses(
    runtime: Any, data: TrainData, count: int, micro_batch: int
) -> tuple[float | None, dict[str, float] | None]:
    """(eval loss, per-source losses by name or None for one source) from `runtime.eval_loss`
    over `count` micro-batches of each held-out split; (None, None) without `eval_loss`.
    Collective on N ranks: every rank calls it alike."""
    evaluate = getattr(runtime, "eval_loss", None)
    if evaluate is None:
        return None, None
    if not data.is_mixture:
        return evaluate(data.eval_batches(count, micro_batch)), None
    weights = dict(zip(data.sampler.names, data.sampler.weights, strict=True))
    losses = {name: evaluate(b) for name, b in data.eval_sets(count, micro_batch).items() if b}
    if not losses:
        return None, None
    total = sum(weights[name] for name in losses) or 1.0
    return sum(weights[name] * loss for name, loss in losses.items()) / total, losses
