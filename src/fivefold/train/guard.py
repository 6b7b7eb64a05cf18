"""The NaN guard: a step whose loss or gradient norm is not finite stops the run with a
TrainingError that names the step, the last good checkpoint and the levers to try."""

from __future__ import annotations

import math
from pathlib import Path

from fivefold.errors import TrainingError
from fivefold.train.config import TrainConfig


def check_finite(
    loss: float,
    grad_norm: float | None,
    lr: float,
    cfg: TrainConfig,
    next_step: int,
    last_checkpoint: Path | None,
    step: int | None = None,
) -> None:
    """Raise when `loss` or `grad_norm` is not finite. `next_step`: the step about to take its
    optimizer step; `step`: an earlier step whose values are read back only now (its optimizer
    step ran), None when the values are `next_step`'s own."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
    when = "so training stopped before the optimizer step"
    if step is not None:
        when = (
            f"read back at step {next_step} (values are read back from the device every "
            f"train.log_every = {cfg.log_every} steps and at checkpoints), so training "
            "stopped there"
        )
    where = (
        f"the last good checkpoint is {last_checkpoint} (continue from it with --resume)"
        if last_checkpoint is not None
        else "no checkpoint was saved before it (set train.ckpt_every to keep some)"
    )
    clip = (
        f"train.grad_clip is {cfg.grad_clip}"
        if cfg.grad_clip > 0
        else "enable clipping with train.grad_clip = 1.0"
    )
    raise TrainingError(
        f"step {step or next_step}: {what}, {when}; "
        f"{where}. Try a lower learning rate (train.lr = {cfg.lr:g}, this step used "
        f"{lr:.3g}), a longer train.warmup_steps, or {clip}; plan.precision = 'fp32' rules "
        "out bf16 overflow."
    )
