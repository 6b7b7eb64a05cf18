"""`LocalRuntime` (the whole model in one process) and `make_runtime`, which picks it or the
distributed runtime.

The Runtime protocol and `StepResult` live below both runtimes, in `fivefold.parallel.protocol`
(the loop imports them from here or there alike): the loop asks a Runtime for a step's forward
and backward over the micro-batches of a global batch, for the global gradient norm, and for
peak memory, and steps an optimizer over `runtime.model_parts`. `LocalRuntime` runs the whole
model in this process; `fivefold.parallel.distributed_runtime.DistributedRuntime` (chosen by
`make_runtime` under torchrun) applies a ParallelPlan and keeps the same contract, so every
layout reports the same loss. Both build on `fivefold.parallel.runtime_core`: start-up, FP8,
recompute, compile, the model call, the token count and the peak-memory record are written
there once.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fivefold import model as models
from fivefold.errors import ConfigError
from fivefold.model.loss import head_loss
from fivefold.parallel.protocol import Runtime, StepResult, TrainSettings, batch_to, label_count
from fivefold.parallel.runtime_core import (
    RuntimeCore,
    apply_fp8,
    apply_recompute_and_compile,
    logits,
    token_count,
)
from fivefold.specs.recipe import Recipe
from fivefold.train.memory_counter import track_cpu_peak

__all__ = ["LocalRuntime", "Runtime", "StepResult", "distributed_runtime", "make_runtime"]


class LocalRuntime(RuntimeCore):
    """The whole model in one process: gradient accumulation, autocast, recompute, clipping."""

    def __init__(self, recipe: Recipe, train: TrainSettings):
        super().__init__(recipe, train)
        self.dp_rank, self.dp_size, self.world_size, self.is_main = 0, 1, 1, True
        model = models.build_model(recipe.model)
        apply_fp8(model, recipe.plan, self.device)
        model.to_empty(device=self.device)
        model.init_weights(seed=train.seed)
        model.head_in_loss = True
        apply_recompute_and_compile(model, recipe.plan, self.device, self.compiled)
        self.model = model
        self.model_parts: list[nn.Module] = [model]
        self._start_peak_statistics()

    def _autocast(self):
        dtype = self.precision.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def _forward_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = batch_to(batch, self.device)
        with self._autocast():  # the head's matmuls in the autocast dtype, the softmax in fp32
            loss = head_loss(self.model, logits(self.model, batch), batch.labels)
        aux = self.model.aux_loss() if self.recipe.model.is_moe else None
        return loss, aux

    def train_step(self, micro_batches: list) -> StepResult:
        """Forward and backward over every micro-batch; grads are summed into `.grad`.

        Each micro-batch's mean loss is weighted by its share of the step's counted tokens, so
        the gradient is that of the mean over all tokens of the global batch.
        """
        self.model.train()
        counts = [label_count(b) for b in micro_batches]  # on the host: no device sync
        total = max(1, token_count(micro_batches))
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        for batch, count in zip(micro_batches, counts, strict=True):
            loss, aux = self._forward_loss(batch)
            objective = loss * (count / total)
            if aux is not None:
                objective = objective + aux / len(micro_batches)
                aux_sum += aux.detach() / len(micro_batches)
            objective.backward()
            loss_sum += loss.detach() * (count / total)
        return StepResult(loss_sum, aux_sum)

    @torch.no_grad()
    def eval_loss(self, batches: list) -> float:
        """Mean token loss over `batches` without gradients (the held-out loss)."""
        self.model.eval()
        counts = [label_count(b) for b in batches]
        total = max(1, token_count(batches))
        loss_sum = 0.0
        for batch, count in zip(batches, counts, strict=True):
            loss, _ = self._forward_loss(batch)
            loss_sum += float(loss) * count / total
        self.model.train()
        return loss_sum

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients before clipping (a 0-d tensor on the device: no host
        sync); clips to `max_norm` if it is > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = max_norm if max_norm > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)

    def close(self, failed: bool = False) -> None:
        """Nothing to release in one process (`failed`: the run ended by an exception)."""


def distributed_runtime(recipe: Recipe, train: TrainSettings) -> Runtime:
    """This rank's `DistributedRuntime` (under torchrun) with the run's [train] settings and the
    loop's CPU memory tracker."""
    from fivefold.parallel.distributed_runtime import (
        DistributedRuntime,  # FSDP and meshes: torchrun only
    )

    return DistributedRuntime(recipe, train, track_cpu_peak)


def make_runtime(recipe: Recipe, train: TrainSettings) -> Runtime:
    """LocalRuntime in a single process; the distributed runtime under torchrun (WORLD_SIZE > 1).
    `train`: the run's [train] settings, parsed once by `load_run` (`RunConfig.train`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return distributed_runtime(recipe, train)
    if recipe.plan.world_size != 1:
        raise ConfigError(
            f"the plan needs {recipe.plan.world_size} processes ({recipe.plan.describe()}) but "
            "this is a single process; start it with `fivefold train --nproc "
            f"{recipe.plan.world_size} ...` or set every plan degree to 1."
        )
    return LocalRuntime(recipe, train)
