"""`DistributedRuntime`: one rank of a run under torchrun, implementing the train loop's Runtime.

Construction (collective: every rank runs it):
1. the process group from the torchrun environment (gloo on CPU, NCCL on CUDA), unless one is
   already initialised (tests share one group across many runtimes);
2. `ParallelDims` checks the plan against the world size and builds the 5-D mesh;
3. the model is built on the meta device, split into this rank's pipeline chunks, and
   parallelised in the fixed order (`fivefold.parallel.parallelize`);
4. the chunks are materialised (each rank allocates only its shards) and initialised from
   (seed, parameter name, global index): each rank draws only the elements it keeps, so no
   rank ever holds a full parameter it does not keep, and every layout starts from the
   single-process weights.

A step (`train_step`) runs the micro-batches of this rank's data-parallel slice: each rank's
loss is the sum of its token losses divided by the number of tokens in the *global* batch, and
gradients are summed (not averaged) over the data-parallel group, so the gradient is exactly
that of the global mean loss whatever the layout. Gradients are communicated only after the last
micro-batch (ZeRO-2/3: after each, so they stay sharded). The reported loss is the global mean,
the same on every rank.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from fivefold.model import build_model
from fivefold.model import init as model_init
from fivefold.model.loss import head_loss
from fivefold.model.transformer import init_aliases
from fivefold.parallel.context_parallel import shard_batch_for_cp
from fivefold.parallel.data_parallel import set_gradient_sync
from fivefold.parallel.grad_norm import clip_grads, global_grad_norm
from fivefold.parallel.lowbit import adam_state_bytes
from fivefold.parallel.mesh import Meshes, ParallelDims
from fivefold.parallel.parallelize import parallelize_chunk
from fivefold.parallel.pipeline import PipelineRunner, split_model_for_pipeline
from fivefold.parallel.process_group import (
    collective_guard,
    init_distributed,
    shorten_timeout_after_first_step,
)
from fivefold.parallel.protocol import StepResult, TrainSettings, batch_to
from fivefold.parallel.report import format_rows, record, stage_rows
from fivefold.parallel.runtime_core import RuntimeCore, logits, token_count
from fivefold.parallel.tied_embeddings import TiedEmbeddings
from fivefold.parallel.wait_clock import WaitClock
from fivefold.specs.recipe import Recipe

# How the runtime measures its own CPU peak when the loop does not: a context manager over
# (modules, optimizer) whose value has `peak_bytes` (the loop passes
# `fivefold.train.memory_counter.track_cpu_peak`; None measures nothing).
PeakTracker = Callable[[list[nn.Module], Any], AbstractContextManager[Any]]


def _scalar(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (possibly DTensor) scalar, detached."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return x.detach().float()


class DistributedRuntime(RuntimeCore):
    """The Runtime protocol on N processes for any valid ParallelPlan (see the module docstring).

    `train`: the run's [train] settings (device, seed, steps, memory_step); `track_peak`: see
    `PeakTracker`. `fivefold.train.runtime.make_runtime` builds it with both.

    Attributes: `model_parts` (this rank's chunks; the optimizer steps their parameters),
    `device`, `precision`, `dp_rank`/`dp_size` (for the sampler), `is_main`, `world_size`,
    `rank`, `dims`, `meshes`, `coordinates` (this rank's index on each mesh axis).
    """

    def __init__(self, recipe: Recipe, train: TrainSettings, track_peak: PeakTracker | None = None):
        # 1. Before any process group or collective: the plan's rules (a refusal is the same
        # error on every rank), the device, the precision on it, the seed.
        super().__init__(recipe, train)
        self.plan, self.spec = recipe.plan, recipe.model
        self._track_peak = track_peak
        # 2. the process group (gloo on CPU, NCCL on CUDA) and 3. the 5-D mesh
        self._owns_group = init_distributed(self.device, trace_dir=_comm_trace_dir(train))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.dims = ParallelDims.from_plan(self.plan, self.world_size)
        self.coordinates = self.dims.coordinates(self.rank)
        self.dp_rank, self.dp_size = self.dims.dp_rank(self.rank), self.dims.dp
        self.meshes: Meshes = self.dims.build_meshes(self.device.type, self.spec.is_moe)
        self.pp_rank, self.cp_rank = self.coordinates["pp"], self.coordinates["cp"]
        # 4. the model on meta, this rank's chunks, parallelised, materialised, initialised
        self.model_parts: list[nn.Module] = self._build_parts(train.seed, train.compile)
        # 5. what spans the chunks: tied embeddings, the wait clock, the pipeline, aux losses
        self.tied = TiedEmbeddings(self.model_parts, self.plan, self.spec)
        self.wait_clock = WaitClock(self.device)  # waits in the collectives below (stragglers)
        self.wait_clock.watch(self.dp_modules)  # and in FSDP's and DTensor's
        self.pipeline = self._build_pipeline()
        self._weight_aux_losses()
        self._start_step_records(train)
        self._start_peak_statistics()
        if self.is_main:
            print(self.describe_layout(), flush=True)

    def _start_step_records(self, train: TrainSettings) -> None:
        """The step counter, the loss scale and the layout report's step and records."""
        self._loss_scale = 1.0
        self._steps = 0
        self.last_report: str | None = None  # rank 0: the layout report, once it was printed
        self.plan_vs_run: dict | None = None  # rank 0: the same as a metrics.jsonl record
        self._step_times_s: list[float] = []
        # On CPU the loop counts memory in step `memory_step` and the runtime in the report's
        # step, each with a dispatch mode that slows every op: neither step is timed, so the
        # report waits for one step after the warm-up that no counter slowed.
        # On CUDA the loop measures step `memory_step` from reset peak statistics: the report
        # waits for it the same way.
        self._loop_memory_step = train.memory_step
        self._report_at = min(4 if self._loop_memory_step == 2 else 3, train.steps)

    def _build_parts(self, seed: int, compile: bool = False) -> list[nn.Module]:
        """This rank's chunks: meta model -> pipeline split -> parallelised -> materialised and
        initialised shard by shard from (seed, parameter name, global index)."""
        model = build_model(self.spec)
        chunks = [model]
        if self.plan.pp > 1:
            chunks = split_model_for_pipeline(model, self.plan, self.pp_rank)
        self.dp_modules = []
        for chunk in chunks:
            self.dp_modules += parallelize_chunk(
                chunk, self.spec, self.plan, self.meshes, self.device, compile
            )
        for chunk in chunks:
            chunk.head_in_loss = True  # the loss applies the head: no [b, T, V] logits
            chunk.to_empty(device=self.device)
            # looked up at call time: `fivefold plan check` replaces it under fake tensors
            model_init.init_module_weights(
                chunk, seed, layers=self.spec.layers, aliases=init_aliases(self.spec)
            )
        return chunks

    def _build_pipeline(self):
        if self.plan.pp == 1:
            return None
        # The loss function already divides by the global token count: no rescaling by torch.
        return PipelineRunner(
            self.model_parts,
            self.plan,
            self.meshes["pp"],
            self._pipeline_loss,
            self.device,
            scale_grads=False,
        )

    # ---- description -----------------------------------------------------------------------
    def describe_layout(self) -> str:
        local = sum(_local_numel(p) for part in self.model_parts for p in part.parameters())
        return (
            f"parallel runtime: {self.dims.describe()}, backend {dist.get_backend()}, device "
            f"{self.device}; rank 0 holds {local:,} parameter elements in "
            f"{len(self.model_parts)} chunk(s)"
        )

    def _weight_aux_losses(self) -> None:
        """Fold the aux loss's weight in the step objective into every MoE's coefficient.

        The objective is the mean over micro-batches of (global-batch CE + aux), and gradients
        are summed over the ranks that route different tokens (`Meshes.routing`: dp_cp, x tp
        for a MoE under TP), each of which backpropagates its own copy of a micro-batch's aux
        loss (the same global value on every rank, its gradient through the local router
        probabilities): hence coef / (micro-batches * those ranks). This also covers pipeline
        stages, whose aux losses are seeded with gradient 1 inside the pipeline.
        """
        weight = 1.0 / (self.plan.grad_accum * self.meshes.routing.size())
        for part in self.model_parts:
            for block in part.layers.values():
                moe = getattr(block, "moe", None)
                if moe is not None:
                    moe.aux_loss_coef = self.spec.router_aux_loss_coef * weight

    # ---- the step ----------------------------------------------------------------------------
    def _loss_context(self):
        if self.plan.tp > 1:
            return loss_parallel()
        return contextlib.nullcontext()

    def _head_part(self) -> nn.Module | None:
        """This rank's chunk holding the LM head (None on pipeline ranks without the last)."""
        return next((p for p in self.model_parts if p.output is not None), None)

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return head_loss(self._head_part(), output, labels, "sum", self._loss_scale)

    def _prepare(self, batch: Any) -> Any:
        batch = batch_to(batch, self.device)
        if self.plan.cp > 1:
            batch = shard_batch_for_cp(batch, self.cp_rank, self.plan.cp)
        return batch

    def _zero(self) -> torch.Tensor:
        """A float64 accumulator on the device (NCCL reduces device tensors only)."""
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _global_token_count(self, micro_batches: list) -> torch.Tensor:
        """The labelled tokens of the global batch (at least 1) as a 0-d float64 tensor on the
        device: counted on the host per rank (`label_count`), summed by an all-reduce that the
        host does not wait for."""
        local = token_count(micro_batches)
        count = torch.tensor([local], dtype=torch.float64).to(self.device, non_blocking=True)
        with self.wait_clock.waiting():
            dist.all_reduce(count, group=self.meshes.dp.get_group())
        return count[0].clamp_min(1)

    def train_step(self, micro_batches: list):
        """Forward and backward over this rank's micro-batches (see the module docstring).

        A collective that times out waiting for a stuck or dead rank ends in a TrainingError
        that says so (`fivefold.parallel.process_group.collective_guard`).
        """
        with collective_guard(f"step {self._steps + 1}"):
            return self._train_step(micro_batches)

    def _train_step(self, micro_batches: list) -> StepResult:
        measure = self._measures_memory_now()
        start = time.perf_counter()
        for part in self.model_parts:
            part.train()
        timed = self.device.type == "cuda" and self._steps < self._report_at
        if timed:  # synchronise only to time the steps the layout report compares
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
        # fp32, as the Python float it replaces: the losses it scales keep their dtype.
        self._loss_scale = (1.0 / self._global_token_count(micro_batches)).float()
        batches = [self._prepare(b) for b in micro_batches]
        with self._memory_tracker(measure):
            if self.pipeline is not None:
                loss_local, aux_local = self._pipeline_step(batches)
                self.tied.sum_grads()
            else:
                loss_local, aux_local = self._local_step(batches)
        loss, aux = self._global_mean(loss_local, aux_local)
        if timed:
            torch.cuda.synchronize(self.device)
        self._after_step(time.perf_counter() - start, timed=not measure)

        return StepResult(loss, aux)

    def _local_step(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model_parts[0]
        loss_sum = self._zero()
        aux_sum = self._zero()
        for index, batch in enumerate(batches):
            set_gradient_sync(self.dp_modules, self.plan, index == len(batches) - 1)
            with self._loss_context():
                loss = self._forward_loss(model, batch)
                objective = loss
                if self.spec.is_moe:
                    aux = model.aux_loss()  # already weighted, see _weight_aux_losses
                    if isinstance(objective, DTensor):  # loss_parallel's replicated loss
                        objective = objective.to_local()
                    objective = objective + aux
                    aux_sum += _scalar(aux).double()
                objective.backward()
            loss_sum += _scalar(loss).double()
        return loss_sum, aux_sum

    def _forward_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The micro-batch's scaled loss; the logits die here, not held through the backward
        (the loss keeps what its backward needs)."""
        output = logits(model, batch)
        return head_loss(model, output, batch.labels, "sum", self._loss_scale)

    def _pipeline_step(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        with self._loss_context():
            losses = self.pipeline.step(batches)
        loss_sum = self._zero()
        for loss in losses:
            loss_sum += _scalar(loss).double()
        aux_sum = self._zero()
        for aux in self._pipeline_aux_values():
            aux_sum += _scalar(aux).double()
        return loss_sum, aux_sum

    def _pipeline_aux_values(self) -> list[torch.Tensor]:
        """The aux losses of this step's micro-batch forwards: one per (MoE chunk, micro-batch).
        On the first step the pipeline also records its shape-inference forward (placeholder
        inputs, so a meaningless value); keep only the last forwards."""
        values = self.pipeline.aux_losses()
        moe_chunks = sum(
            any(getattr(b, "moe", None) is not None for b in part.layers.values())
            for part in self.model_parts
        )
        expected = moe_chunks * self.plan.grad_accum
        return values[len(values) - expected :] if expected else []

    def _global_mean(
        self, loss_local: torch.Tensor, aux_local: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the per-rank contributions over the world; TP ranks hold identical copies of the
        loss, while the aux losses are already weighted by the ranks that hold them
        (`_weight_aux_losses`). 0-d tensors on the device: the host does not wait for them."""
        both = torch.stack([loss_local, aux_local])
        with self.wait_clock.waiting():
            dist.all_reduce(both)
        return both[0] / self.plan.tp, both[1]

    @torch.no_grad()
    def eval_loss(self, batches: list) -> float:
        """Mean token loss over every rank's `batches` (this rank's data-parallel share), no
        gradients; the same number on every rank (pipelines: the runner's forward-only pass)."""
        for part in self.model_parts:
            part.eval()
        try:
            scale = 1.0 / self._global_token_count(batches)
            batches = [self._prepare(b) for b in batches]
            total = self._zero()
            if self.pipeline is not None:
                with self._loss_context():
                    mean = self.pipeline.eval(batches)  # the same on every pipeline rank
                tokens = token_count(batches)
                if self.pipeline.has_last and tokens:  # one copy per pipeline in the world sum
                    total += mean * tokens * scale
            else:
                model = self.model_parts[0]
                for batch in batches:
                    with self._loss_context():
                        output = logits(model, batch, documents=False)
                        loss = head_loss(model, output, batch.labels, "sum")
                        total += _scalar(loss).double() * scale
            loss, _ = self._global_mean(total, self._zero())
            return float(loss)
        finally:
            for part in self.model_parts:
                part.train()

    # ---- gradients ---------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        return [
            p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None
        ]

    @torch.no_grad()
    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm over every shard, stage and rank (a 0-d tensor on the device: no
        host sync); clips to `max_norm` when it is > 0."""
        grads = self._grads()
        excluded = self.tied.norm_excluded()  # a tied matrix counts once
        counted = [
            p.grad
            for part in self.model_parts
            for p in part.parameters()
            if p.grad is not None and id(p) not in excluded
        ]
        what = f"step {self._steps}: the gradient-norm all-reduce"
        with collective_guard(what), self.wait_clock.waiting():
            total = global_grad_norm(counted, self.plan.pp)
        if max_norm > 0:
            clip_grads(grads, max_norm, total)
        return total

    def _balance_group(self) -> dist.ProcessGroup:
        """The ranks whose MoE layers route other tokens of the step (`Meshes.routing`: data x
        context parallel, x tensor parallel when MoE splits the tokens over TP)."""
        return (self.meshes.routing or self.meshes.dp_cp).get_group()

    # ---- measurements ------------------------------------------------------------------------
    def _measures_memory_now(self) -> bool:
        """CPU: track allocations during the step before the report (unless the loop does)."""
        step = self._steps + 1
        return (
            self._track_peak is not None
            and self.device.type == "cpu"
            and step == self._report_at
            and step != self._loop_memory_step
        )

    @contextlib.contextmanager
    def _memory_tracker(self, active: bool):
        if not active:
            yield
            return
        assert self._track_peak is not None
        with self._track_peak(self.model_parts, None) as reading:
            yield
        adam = int(  # AdamW m and v, which this block does not see
            sum(
                adam_state_bytes(_local_numel(p), self.plan.optimizer_states)
                for part in self.model_parts
                for p in part.parameters()
            )
        )
        tenants = {**reading.tenants, "optimizer": reading.tenants.get("optimizer", 0) + adam}
        self.record_peak_memory(reading.peak_bytes + adam, tenants)

    def _after_step(self, seconds: float, timed: bool = True) -> None:
        self._steps += 1
        if self._steps == 1:  # NCCL: the start-up timeout gives way to the shorter step one
            shorten_timeout_after_first_step(self.device)
        timed = timed and self._steps != self._loop_memory_step
        if self._steps > 1 and timed:  # the first step pays one-off set-up costs
            self._step_times_s.append(seconds)
        if self._steps == self._report_at:
            result = stage_rows(self)
            if result is not None:
                self.last_report = format_rows(self.plan.describe(), *result)
                self.plan_vs_run = record(*result)
                print(self.last_report, flush=True)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (collective: one tiny all-reduce).
        The loop asks it after each step whether a rank was interrupted."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        what = f"step {self._steps}: the stop-signal all-reduce"
        with collective_guard(what), self.wait_clock.waiting():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def gather_timing(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (e.g. compute and wait seconds), by rank (collective: one small
        all-gather over the world)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with collective_guard(f"step {self._steps}: the straggler-timing all-gather"):
            dist.all_gather(out, mine)
        return torch.stack(out).tolist()

    def gather_places(self) -> list[tuple[str, int]]:
        """Every rank's (host name, local device index), by rank (collective)."""
        place = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", self.rank)))
        out: list = [None] * self.world_size
        with collective_guard("the straggler report's host all-gather"):
            dist.all_gather_object(out, place)
        return [tuple(p) for p in out]

    def close(self, failed: bool = False) -> None:
        """Release the process group this runtime created. After a clean run all ranks meet
        at a barrier first; after an exception (`failed`) no collective runs, since the other
        ranks may be dead or stuck in another one: the group is aborted locally instead."""
        if not (self._owns_group and dist.is_initialized()):
            return
        self._owns_group = False
        if failed:
            abort_process_group()
            return
        dist.barrier()
        dist.destroy_process_group()


def abort_process_group() -> None:
    """Tear down the default group without talking to the other ranks (never blocks on them).
    `_abort_process_group` is PyTorch's own (private) API for this; should it fail, the group is
    left to the process's exit, which the caller is about to reach anyway."""
    # lazily: a private torch API, so a torch without it fails here only, on a failing path
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):  # best effort on a path that is already failing
        _abort_process_group()


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _comm_trace_dir(train: TrainSettings) -> Path | None:
    """`<run dir>/comm_traces`, where NCCL's flight recorder writes on a timeout."""
    path = getattr(train, "path", None)
    return Path(path()) / "comm_traces" if callable(path) else None
