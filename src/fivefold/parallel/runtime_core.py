"""What both runtimes do alike, written once: `RuntimeCore` (the checks, device, precision and
seed at start-up; the peak-memory record; the gradient-norm read-back), the per-chunk levers
(`apply_fp8` before any parallelism, `apply_recompute_and_compile` after it), the model's call
on a batch (`logits`) and the step's token count that weights each micro-batch's loss
(`token_count`).

`fivefold.train.runtime.LocalRuntime` (the whole model in one process) and
`fivefold.parallel.distributed_runtime.DistributedRuntime` (one rank under torchrun) build on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fivefold.model.routers import balance_router_biases
from fivefold.parallel.activation_checkpoint import apply_recompute
from fivefold.parallel.device import pick_device
from fivefold.parallel.mixed_precision import RuntimePrecision, resolve_precision
from fivefold.parallel.protocol import TrainSettings, label_count
from fivefold.parallel.sp_regather import apply_sp_regather
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.recipe import Recipe


class RuntimeCore:
    """Start-up and bookkeeping shared by the runtimes.

    Start-up: the recipe's one set of rules (`ParallelPlan.validate`; a refusal is the same
    ConfigError on every rank, before any collective), the device `train.device` names, the
    plan's precision on it, and the RNG seeded with `train.seed`. Attributes: `recipe`,
    `device`, `precision`, `compiled` (the memory prediction counts compiled blocks),
    `peak_tenants`, `peak_reserved_bytes`.
    """

    def __init__(self, recipe: Recipe, train: TrainSettings):
        recipe.plan.validate(recipe.model, recipe.cluster)
        self.recipe = recipe
        self.device = pick_device(train.device)
        self.precision: RuntimePrecision = resolve_precision(recipe.plan.precision, self.device)
        self.compiled = bool(getattr(train, "compile", False))
        self._peak_bytes = 0
        self.peak_tenants: dict[str, int] = {}  # the measured peak split into tenants (CPU)
        self.peak_reserved_bytes = 0  # CUDA: reserved peak + context of the measured step
        torch.manual_seed(train.seed)

    def _start_peak_statistics(self) -> None:
        """CUDA: the allocator's peak counts from here (the model built)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def clip_grads(self, max_norm: float) -> torch.Tensor:  # each runtime defines it
        raise NotImplementedError

    def balance_routers(self) -> None:
        """After an optimizer step: the auxiliary-loss-free update of the routers' score
        biases (`fivefold.model.routers.balance_router_biases`), the expert loads summed over
        the ranks that see other tokens of the same layers (`_balance_group`)."""
        routings = [moe.routing for part in self.model_parts for moe in part.moe_layers()]
        balance_router_biases(routings, self._balance_group())

    def _balance_group(self) -> Any:
        return None  # one process

    def clip_grad_norm(self, max_norm: float) -> float:
        """`clip_grads`, read back as a float."""
        return float(self.clip_grads(max_norm))

    def record_peak_memory(
        self, peak_bytes: int, tenants: dict[str, int] | None = None, reserved_bytes: int = 0
    ) -> None:
        """A measurement of one step's peak (CPU: tensor storages; CUDA: the allocator's peak
        from statistics reset before the step) with its split into tenants
        (`fivefold.train.memory_counter.TENANTS`) and the reserved peak plus the CUDA context; the
        largest is kept."""
        if int(peak_bytes) > self._peak_bytes:
            self._peak_bytes = int(peak_bytes)
            self.peak_tenants = dict(tenants or {})
            self.peak_reserved_bytes = int(reserved_bytes)

    def peak_memory_bytes(self) -> int:
        """The largest recorded measurement; before one, CUDA: the allocator's peak since
        start-up, CPU: 0."""
        if self._peak_bytes or self.device.type != "cuda":
            return self._peak_bytes
        return int(torch.cuda.max_memory_allocated(self.device))


def apply_fp8(chunk: nn.Module, plan: ParallelPlan, device: torch.device) -> None:
    """`plan.fp8`'s FP8 linears on `chunk`, before any parallelism (none: nothing)."""
    if plan.fp8 != "none":
        from fivefold.parallel.float8 import apply_float8  # torchao, only when asked

        apply_float8(chunk, plan, device)


def apply_recompute_and_compile(
    chunk: nn.Module, plan: ParallelPlan, device: torch.device, compile: bool
) -> None:
    """`plan.recompute` on every block of `chunk`, then torch.compile per block (`compile`).
    Eager blocks under TP+SP keep their gathered inputs as the sequence shard
    (`fivefold.parallel.sp_regather`)."""
    apply_recompute(chunk, plan.recompute)
    if plan.tp > 1 and plan.sp and not compile:
        for block in chunk.layers.values():
            apply_sp_regather(block)
    if compile:
        from fivefold.parallel.compile import apply_compile, check_compiler  # torch._dynamo

        check_compiler(device)
        apply_compile(chunk)


def logits(model: nn.Module, batch: Any, documents: bool = True) -> torch.Tensor:
    """`model`'s logits [micro_batch, seq, vocab] on `batch` (on the model's device);
    `documents`: pass the packed documents' boundaries (`cu_seqlens`) when the batch has them."""
    cu_seqlens = getattr(batch, "cu_seqlens", None) if documents else None
    return model(
        batch.tokens, positions=batch.positions, doc_ids=batch.doc_ids, cu_seqlens=cu_seqlens
    )


def token_count(batches: list) -> int:
    """The labelled tokens of `batches`, counted on the host (no device sync): each micro-batch's
    loss counts by its share of the step's count."""
    return sum(label_count(b) for b in batches)
