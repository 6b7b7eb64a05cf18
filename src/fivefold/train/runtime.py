"""The Runtime protocol (how the loop drives one rank) and `LocalRuntime`, its one-process form.

The loop never touches parallelism: it asks a Runtime for a step's forward and backward over the
micro-batches of a global batch, for the global gradient norm, and for peak memory, and it steps
an optimizer over `runtime.model_parts`. `LocalRuntime` runs the whole model in this process;
`fivefold.parallel.runtime.DistributedRuntime` (chosen by `make_runtime` under torchrun) applies a
ParallelPlan and keeps the same contract, so every layout reports the same loss.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.spec.recipe import Recipe
from fivefold.train.config import parse_train_config
from fivefold.train.precision import RuntimePrecision, resolve_precision
from fivefold.train.recompute import apply_recompute

IGNORE_INDEX = -100


@dataclass(frozen=True)
class StepResult:
    """`loss`: mean token cross-entropy over the whole global batch (same on every rank);
    `aux_loss`: the MoE load-balancing loss added to it for backward (mean over micro-batches)."""

    loss: float
    aux_loss: float = 0.0


@runtime_checkable
class Runtime(Protocol):
    model_parts: list[nn.Module]
    device: torch.device
    dp_rank: int
    dp_size: int
    is_main: bool
    world_size: int

    def train_step(self, micro_batches: list) -> StepResult: ...

    def clip_grad_norm(self, max_norm: float) -> float: ...

    def peak_memory_bytes(self) -> int: ...

    def close(self) -> None: ...


def pick_device(name: str) -> torch.device:
    """`train.device`: "auto" picks CUDA when available, else CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto'.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def batch_to(batch, device: torch.device):
    """The same Batch with every tensor field on `device`; on CUDA through pinned host memory,
    copied without blocking the host."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    moved = {
        f.name: move(getattr(batch, f.name))
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


class LocalRuntime:
    """The whole model in one process: gradient accumulation, autocast, recompute, clipping."""

    def __init__(self, recipe: Recipe):
        from fivefold.model import build_model

        train = parse_train_config(recipe).train
        self.recipe = recipe
        self.device = pick_device(train.device)
        self.precision: RuntimePrecision = resolve_precision(recipe.plan.precision, self.device)
        self.dp_rank, self.dp_size, self.world_size, self.is_main = 0, 1, 1, True
        torch.manual_seed(train.seed)
        model = build_model(recipe.model)
        model.to_empty(device=self.device)
        model.init_weights(seed=train.seed)
        apply_recompute(model, recipe.plan.recompute)
        if train.compile:
            from fivefold.parallel.compile import apply_compile, check_compiler

            check_compiler(self.device)
            apply_compile(model)
        self.model = model
        self.model_parts: list[nn.Module] = [model]
        self._recorded_peak_bytes = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _autocast(self):
        dtype = self.precision.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def _forward_loss(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        from fivefold.model import cross_entropy_loss

        batch = batch_to(batch, self.device)
        with self._autocast():
            logits = self.model(batch.tokens, positions=batch.positions, doc_ids=batch.doc_ids)
        loss = cross_entropy_loss(logits.float(), batch.labels)
        aux = self.model.aux_loss() if self.recipe.model.is_moe else None
        return loss, aux

    def train_step(self, micro_batches: list) -> StepResult:
        """Forward and backward over every micro-batch; grads are summed into `.grad`.

        Each micro-batch's mean loss is weighted by its share of the step's counted tokens, so
        the gradient is that of the mean over all tokens of the global batch.
        """
        self.model.train()
        counts = [int((b.labels != IGNORE_INDEX).sum()) for b in micro_batches]
        total = max(1, sum(counts))
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
        return StepResult(loss=float(loss_sum), aux_loss=float(aux_sum))

    @torch.no_grad()
    def eval_loss(self, batches: list) -> float:
        """Mean token loss over `batches` without gradients (the held-out loss)."""
        self.model.eval()
        counts = [int((b.labels != IGNORE_INDEX).sum()) for b in batches]
        total = max(1, sum(counts))
        loss_sum = 0.0
        for batch, count in zip(batches, counts, strict=True):
            loss, _ = self._forward_loss(batch)
            loss_sum += float(loss) * count / total
        self.model.train()
        return loss_sum

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of all gradients before clipping; clips to `max_norm` if it is > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = max_norm if max_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, limit, foreach=True))

    def peak_memory_bytes(self) -> int:
        """CUDA: the allocator's peak since start. CPU: the loop's measurement of one step
        (`record_peak_memory`), 0 before it."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._recorded_peak_bytes

    def record_peak_memory(self, peak_bytes: int) -> None:
        """Keep the loop's CPU measurement (tensor storages counted over one step)."""
        self._recorded_peak_bytes = max(self._recorded_peak_bytes, int(peak_bytes))

    def close(self) -> None:
        pass


def make_runtime(recipe: Recipe) -> Runtime:
    """LocalRuntime in a single process; the distributed runtime under torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        try:
            from fivefold.parallel.runtime import DistributedRuntime
        except ImportError as err:
            raise ConfigError(
                "this run was started with WORLD_SIZE > 1 but fivefold.parallel.runtime is not "
                f"available yet ({err}); run a single process (no torchrun, --nproc 1)."
            ) from None
        return DistributedRuntime(recipe)
    if recipe.plan.world_size != 1:
        raise ConfigError(
            f"the plan needs {recipe.plan.world_size} processes ({recipe.plan.describe()}) but "
            "this is a single process; start it with `fivefold train --nproc "
            f"{recipe.plan.world_size} ...` or set every plan degree to 1."
        )
    return LocalRuntime(recipe)
