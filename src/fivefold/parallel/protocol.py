"""What the training loop and a runtime exchange: the `Runtime` protocol, `StepResult`, and the
one way a batch reaches the runtime's device.

The loop (`fivefold.train.loop`) never touches parallelism: it asks a Runtime for a step's
forward and backward over the micro-batches of a global batch, for the global gradient norm and
for peak memory, and it steps an optimizer over `runtime.model_parts`. Both runtimes implement
it: `fivefold.train.runtime.LocalRuntime` (one process) and
`fivefold.parallel.distributed_runtime.DistributedRuntime` (any ParallelPlan). This module sits
below both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from fivefold.model.loss import IGNORE_INDEX

B = TypeVar("B")


@dataclass(frozen=True)
class StepResult:
    """`loss_tensor`: mean token cross-entropy over the whole global batch (same on every rank);
    `aux_tensor`: the MoE load-balancing loss added to it for backward (mean over
    micro-batches). Both 0-d tensors on the runtime's device, so that a step does not wait for
    the device; `loss` and `aux_loss` read them back (a host sync on an accelerator)."""

    loss_tensor: torch.Tensor
    aux_tensor: torch.Tensor

    @property
    def loss(self) -> float:
        return float(self.loss_tensor)

    @property
    def aux_loss(self) -> float:
        return float(self.aux_tensor)


class TrainSettings(Protocol):
    """What a runtime reads of the run's [train] settings (`fivefold.train.config.TrainConfig`)."""

    device: str  # "auto" | "cpu" | "cuda"
    seed: int
    steps: int
    memory_step: int  # the step whose CPU peak the loop measures (the runtime measures another)


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

    def clip_grads(self, max_norm: float) -> torch.Tensor: ...

    def balance_routers(self) -> None: ...

    def peak_memory_bytes(self) -> int: ...

    def close(self, failed: bool = False) -> None: ...


def label_count(batch: Any) -> int:
    """Tokens of `batch` whose label counts in the loss: the data loader's host-side count
    (`Batch.label_count`), else counted from its labels (a batch built elsewhere; a device
    read-back when they live on an accelerator)."""
    count = getattr(batch, "label_count", None)
    return int(count) if count is not None else int((batch.labels != IGNORE_INDEX).sum())


def batch_to(batch: B, device: torch.device) -> B:
    """The same batch (a dataclass, e.g. `fivefold.train.data.Batch`) with every tensor field
    moved to `device`; other fields (None, ints, host-side NumPy arrays such as the document
    offsets) are kept. On CUDA the copy goes through pinned host memory without blocking the
    host."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    moved: dict[str, Any] = {
        f.name: move(getattr(batch, f.name))
        for f in dataclasses.fields(batch)  # type: ignore[arg-type]
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)  # type: ignore[type-var]
