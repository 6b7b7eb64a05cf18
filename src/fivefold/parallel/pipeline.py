"""Pipeline parallelism: the model cut into stages, run by `torch.distributed.pipelining`.

- `split_model_for_pipeline(model, plan, pp_rank)`: the chunks (virtual stages) this rank owns.
  The cut is the planner's (`fivefold.specs.partition.stage_layer_counts`: balanced by forward
  FLOPs with the LM head counted on the last stage), and so is the placement
  (`fivefold.specs.geometry.chunks_of_rank`: chunk c on rank c % pp, or the V of zbv/dualpipev).
  A chunk is a copy of the `Transformer` without the parts it does not own, so its parameter
  names are those of the full model and `init_weights` gives every rank the same values as the
  single-process model. Call it on the meta model, before the other parallelisms are applied.
- `PipelineRunner(chunks, plan, pp_mesh, loss_fn, device)`: one `PipelineStage` per chunk and
  the torch schedule named by `plan.schedule` (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble,
  DualPipeV) with `plan.grad_accum` micro-batches. `step(micro_batches)` runs forward and
  backward of all of them and returns the per-micro-batch losses on the rank holding the last
  stage ([] elsewhere). `eval(micro_batches)` runs them forward only (the schedule's own
  forward-only mode, every schedule and chunk placement) and returns their mean token cross
  entropy on every pipeline rank. Positions and doc ids reach every stage as keyword arguments
  of the stage forward (torch passes step kwargs, split per micro-batch, to all stages), so
  RoPE and document masks are right on every stage; so do the micro-batches' host document
  offsets (as a host table of each row's document starts), so no stage reads doc ids back.
- MoE load-balancing losses of a chunk are attached to its output with an identity whose
  backward seeds d(aux) = 1 (Megatron's trick), so each stage's aux loss trains its routers
  inside the ordinary pipeline backward. With `scale_grads=True` (the default) torch divides the
  gradients by the number of micro-batches: the loss function should return the micro-batch
  mean, and the gradients are then those of the mean over micro-batches of (loss + aux).
  Only the micro-batch forwards of a training step attach and record aux losses (and count the
  routers' expert loads): torch's shape-inference forward (first step, and again after every
  switch between `eval` and `step`) runs on placeholder inputs and is left alone.
- ZeRO-3 chunks stay gathered across their micro-batches (as torchtitan runs FSDP under PP):
  their FSDP units do not re-shard after each forward, torch's stage keeps them gathered
  between micro-batch backwards, and they are re-sharded once, when the step's gradients are
  reduce-scattered (and after a forward-only `eval`). One all-gather per unit and step instead
  of two per micro-batch, at the price of holding the chunk's full weights during the step.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from fivefold.model.loss import IGNORE_INDEX, cross_entropy_loss, head_loss
from fivefold.specs.geometry import ONE_CHUNK_PER_RANK, V_SHAPED, ScheduleName, chunks_of_rank
from fivefold.specs.partition import stage_layer_counts
from fivefold.specs.plan import ParallelPlan

SCHEDULE_CLASSES = {
    ScheduleName.GPIPE: "ScheduleGPipe",
    ScheduleName.ONE_F_ONE_B: "Schedule1F1B",
    ScheduleName.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    ScheduleName.ZBV: "ScheduleZBVZeroBubble",
    ScheduleName.DUALPIPEV: "ScheduleDualPipeV",
}


# ---- splitting -----------------------------------------------------------------------------------
def stage_layer_ranges(model_spec: Any, plan: ParallelPlan) -> list[range]:
    """Layer indices of every virtual stage, in model order (the planner's partition)."""
    counts = stage_layer_counts(model_spec, plan.pp * plan.vpp)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def split_model_for_pipeline(model: nn.Module, plan: ParallelPlan, pp_rank: int) -> list[nn.Module]:
    """The chunks `pp_rank` owns, each a copy of `model` keeping only its layers (and the
    embedding on the first chunk, the final norm and head on the last; a tied head keeps its
    own copy of the matrix, see `fivefold.parallel.tied_embeddings`). Parameter FQNs are
    unchanged. Chunks carry `stage_index` (their virtual stage). `model` is not modified."""
    spec = model.spec
    ranges = stage_layer_ranges(spec, plan)
    last = len(ranges) - 1
    chunks = []
    for index in chunks_of_rank(plan.schedule, plan.pp, plan.vpp, pp_rank):
        chunk = copy.deepcopy(model)
        keep = {str(i) for i in ranges[index]}
        for name in list(chunk.layers.keys()):
            if name not in keep:
                del chunk.layers[name]
        if index != 0:
            chunk.tok_embeddings = None
        if index != last:
            chunk.norm = None
            chunk.output = None
        chunk.stage_index = index
        chunks.append(chunk)
    return chunks


# ---- aux loss ------------------------------------------------------------------------------------
class _AttachAuxLoss(torch.autograd.Function):
    """Forward: a copy of `output` (a copy, not a view: the pipeline detaches stage outputs in
    place). Backward: passes the output gradient through and gives `aux_loss` the gradient 1,
    so the aux loss is trained by the stage's backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_grad = torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad


def _moe_layers(chunk: nn.Module) -> list[nn.Module]:
    return [b.moe for b in chunk.layers.values() if getattr(b, "moe", None) is not None]


class _AuxLossCollector:
    """Forward hook on a chunk: attaches its MoE aux losses to its output and records them,
    only while `recording()` is open (around a stage's micro-batch forward) and grads are on."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self._recording = False

    @contextlib.contextmanager
    def recording(self):
        previous, self._recording = self._recording, True
        try:
            yield
        finally:
            self._recording = previous

    def before_forward(self, chunk: nn.Module, args: Any) -> None:
        """The routers count expert loads (DeepSeek's balancing) in recorded forwards only."""
        chunk.counts_router_loads = self._recording

    def __call__(self, chunk: nn.Module, args: Any, kwargs: Any, output: torch.Tensor):
        if not self._recording or not torch.is_grad_enabled():
            return None
        losses = [m.aux_loss for m in _moe_layers(chunk) if m.aux_loss is not None]
        if not losses:
            return None
        aux = torch.stack([loss.float() for loss in losses]).sum()
        self.values.append(aux.detach())
        return _AttachAuxLoss.apply(output, aux)


def _recording_stage(
    collector: _AuxLossCollector, release_grad_buffers: bool, *args: Any, **kwargs: Any
):
    """A `PipelineStage` whose micro-batch forwards (and only those: torch's shape inference
    calls the module directly) run inside `collector.recording()`.

    It also makes torch 2.13's forward-only `eval()` safe, which still runs the backward-side
    actions of every schedule: the end-of-step gradient reduction (it would divide the
    accumulated gradients by the micro-batch count again, and run FSDP's post-backward), and in
    the V schedules (zbv, dualpipev) the hand-over of input gradients to the same-rank
    neighbour stage (which fails). Without a backward there is nothing to reduce or hand over.

    And it makes the split backward of zbv/dualpipev (input gradients first, weight gradients
    later) correct under ZeRO-3: see `_unshard_for_split_backward`.

    With `release_grad_buffers` (schedules whose neighbours are on other ranks and whose
    backwards are whole: gpipe, 1f1b, interleaved-1f1b) each micro-batch's receive buffer of
    the output gradient holds memory only from its receive to the end of its backward
    (`_grad_buffers`), not through the step: torch makes one per micro-batch and keeps them."""

    class RecordingStage(PipelineStage):
        def forward_one_chunk(self, *chunk_args: Any, **chunk_kwargs: Any):
            if release_grad_buffers:  # torch makes them all at the first step; its receive
                mb = chunk_args[0] if chunk_args else chunk_kwargs.get("fwd_chunk_id")
                _grad_buffers(self.grad_recv_info.get(mb, ()), held=False)  # comes later
            with collector.recording():
                return super().forward_one_chunk(*chunk_args, **chunk_kwargs)

        def get_local_bwd_output(self, mb_index: int):
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
            if release_grad_buffers:
                _grad_buffers(self.grad_recv_info.get(bwd_chunk_id, ()), held=True)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def backward_one_chunk(
            self,
            bwd_chunk_id: int,
            loss: Any = None,
            full_backward: bool = True,
            last_backward: bool = False,
        ) -> None:
            if self.has_backward and not full_backward:
                _unshard_for_split_backward(self.submod)
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
            if release_grad_buffers and full_backward:
                _grad_buffers(self.grad_recv_info.get(bwd_chunk_id, ()), held=False)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            if self.has_backward:
                _unshard_for_split_backward(self.submod)
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            if self.has_backward:
                super().perform_reduce_grad(grad_scale_factor)

    return RecordingStage(*args, **kwargs)


def _grad_buffers(infos: Any, held: bool) -> None:
    """Give the output-gradient receive buffers of one micro-batch (torch's `_RecvInfo`s)
    their memory back before the receive (`held`), or free it once the backward has read them,
    in place (`UntypedStorage.resize_`, as FSDP2 frees its gathered parameters): the tensors,
    which the schedule's receive ops name, stay the same objects."""
    for info in infos:
        buffer = getattr(info, "buffer", None)
        if not isinstance(buffer, torch.Tensor):
            continue
        storage = buffer.untyped_storage()
        size = buffer.numel() * buffer.element_size() if held else 0
        if storage.nbytes() != size:
            storage.resize_(size)


def _unshard_for_split_backward(chunk: nn.Module) -> None:
    """Gather every FSDP unit of `chunk` before a split (input- or weight-gradient) backward.

    torch 2.13 finds the weights of a split backward as `chunk.parameters()` at the time of the
    call: the input pass records which of them the autograd graph reaches, the weight pass
    computes the gradients of exactly those. Under ZeRO-3 (`reshard_after_forward=True`) every
    forward ends with FSDP registering the *sharded* parameters again, while the graph holds
    the unsharded ones; a micro-batch whose input pass follows a forward of its chunk (which
    zbv and dualpipev schedule) then gets no weight gradients for the blocks, silently. With
    the units gathered, `parameters()` are the graph's tensors again (FSDP reuses one unsharded
    Parameter per weight). It costs no extra all-gather for the input pass (its pre-backward
    hooks would gather the same units) and one per unit for a weight pass that follows a
    re-shard. A no-op for an unsharded unit (ZeRO-1/2 within a step, DDP, no DP).
    """
    for module in chunk.modules():
        if isinstance(module, FSDPModule):
            module.unshard()


def _fsdp_units(chunks: Sequence[nn.Module]) -> list[nn.Module]:
    """Every FSDP-wrapped module of the chunks (blocks, experts, chunk roots)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, FSDPModule)]


def _plain_scalar(x: torch.Tensor) -> torch.Tensor:
    """A detached fp64 plain tensor from a (possibly DTensor, e.g. under loss_parallel) scalar."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return x.detach().double()


# ---- running -------------------------------------------------------------------------------------
class PipelineRunner:
    """Runs the pipeline on this rank's chunks: a training step or a forward-only evaluation
    (see the module docstring).

    chunks: this rank's chunks from `split_model_for_pipeline` (possibly wrapped by TP / FSDP /
    checkpointing, in the same order); pp_mesh: 1-D DeviceMesh (or ProcessGroup) of the pipeline
    ranks; loss_fn(the last chunk's output: logits [b, T, V], or hidden states [b, T, D] where it
    has `head_in_loss`; labels [b, T]) -> scalar loss of one micro-batch. With
    `scale_grads=True` torch divides the gradients by the micro-batch count, so loss_fn should be
    the micro-batch mean; with False the gradients are those of the sum of the returned losses
    (the caller normalises, e.g. token sums divided by the global token count).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        plan: ParallelPlan,
        pp_mesh: Any,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        device: torch.device | str,
        *,
        scale_grads: bool = True,
    ) -> None:
        assert not plan.problems(), plan.problems()  # schedule, vpp, micro-batch count rules
        self.plan = plan
        self.device = torch.device(device)
        self.loss_fn = loss_fn or cross_entropy_loss
        self._evaluating = False
        self.group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
        pp_rank = dist.get_rank(self.group)
        indices = list(chunks_of_rank(plan.schedule, plan.pp, plan.vpp, pp_rank))
        if len(chunks) != len(indices):
            raise ValueError(
                f"pipeline rank {pp_rank} should hold {len(indices)} chunks (stages {indices}) "
                f"for {plan.schedule} with pp={plan.pp}, vpp={plan.vpp}; got {len(chunks)}"
            )
        self.chunks = list(chunks)
        self._fsdp_units = _fsdp_units(self.chunks)
        if plan.zero == 3:
            for unit in self._fsdp_units:
                unit.set_reshard_after_forward(False, recurse=False)
        self.aux = _AuxLossCollector()
        self._hooks = [
            hook
            for c in self.chunks
            if _moe_layers(c)
            for hook in (
                c.register_forward_hook(self.aux, with_kwargs=True),
                c.register_forward_pre_hook(self.aux.before_forward),
            )
        ]
        self._host_offsets: list | None = None  # this step's micro-batches' `cu_seqlens`
        self._hooks += [
            c.register_forward_pre_hook(self._with_host_offsets, with_kwargs=True)
            for c in self.chunks
        ]
        release = plan.schedule not in V_SHAPED  # no same-rank hand-over, whole backwards
        self.stages = [
            _recording_stage(
                self.aux, release, chunk, index, plan.pp * plan.vpp, self.device, group=self.group
            )
            for chunk, index in zip(self.chunks, indices, strict=True)
        ]
        self.has_first = 0 in indices
        self.has_last = plan.pp * plan.vpp - 1 in indices
        schedule_cls = getattr(schedules, SCHEDULE_CLASSES[plan.schedule])
        stages = self.stages[0] if plan.schedule in ONE_CHUNK_PER_RANK else self.stages
        self.schedule = schedule_cls(
            stages,
            n_microbatches=plan.grad_accum,
            loss_fn=self._schedule_loss,
            scale_grads=scale_grads,
        )
        for chunk in self.chunks:  # seen by the memory counter (`fivefold.train.memory_counter`)
            chunk.held_tensors = self.held_tensors

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors torch's stages keep between steps: the per-micro-batch receive buffers of
        activations and of gradients ([b, T, h] each, allocated at the first step; those of
        gradients hold memory only around their backward unless the schedule is V-shaped,
        `_grad_buffers`; a buffer fed
        by a chunk on this rank holds that chunk's last output or input gradient instead) and
        the gradients left on the activation buffers."""
        out: list[torch.Tensor] = []
        for stage in self.stages:
            infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
            for info in (i for group in infos for i in group):
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    out.append(buffer)
                    if buffer.grad is not None:
                        out.append(buffer.grad)
        return out

    def _schedule_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss the schedule computes on the last stage: the caller's loss_fn in a training
        step, the token cross-entropy sum (fp32 scalar) in `eval`."""
        if self._evaluating:
            head = next((c for c in self.chunks if getattr(c, "output", None) is not None), None)
            return head_loss(head, output, labels, reduction="sum")
        return self.loss_fn(output, labels)

    def step(self, micro_batches: list[Any]) -> list[torch.Tensor]:
        """Forward + backward of every micro-batch (Batch: tokens, labels, positions, doc_ids,
        each [b, T], all of the same shape). Returns the detached micro-batch losses on the rank
        holding the last stage, [] elsewhere. Gradients accumulate in the chunks' parameters."""
        args, target, kwargs = self._schedule_inputs(micro_batches)
        self.aux.values.clear()
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        self._reshard()
        return [loss.detach() for loss in losses] if self.has_last else []

    def eval(self, micro_batches: list[Any]) -> float:
        """Forward only (no gradients, no aux losses recorded) over any number of micro-batches
        of one shape (Batch as in `step`): their mean token cross entropy (labels != -100; NaN
        if there are none), the same float on every pipeline rank. They run in rounds of
        `plan.grad_accum`, the last one padded with label-free copies. Collective over the
        pipeline group. Under TP with a vocab-parallel head, call it inside `loss_parallel()`."""
        _check_one_shape(micro_batches)
        rounds = _rounds(micro_batches, self.plan.grad_accum)
        losses: list[torch.Tensor] = []
        self._evaluating = True
        try:
            with torch.no_grad():
                for round_batches in rounds:
                    args, target, kwargs = self._schedule_inputs(round_batches)
                    round_losses: list[torch.Tensor] = []  # the schedule clears it
                    self.schedule.eval(
                        *args, target=target, losses=round_losses, return_outputs=False, **kwargs
                    )
                    losses += round_losses
        finally:
            self._evaluating = False
            self._reshard()
        # [token loss sum, token count], from the last stage only
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.has_last:
            for loss in losses:
                totals[0] += _plain_scalar(loss)
            totals[1] = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in micro_batches)
        dist.all_reduce(totals, group=self.group)
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")

    def aux_losses(self) -> list[torch.Tensor]:
        """This rank's MoE aux losses of the last step, one per (MoE chunk, micro-batch)
        forward; the step's aux loss is their sum over the pipeline ranks divided by the
        micro-batches."""
        return list(self.aux.values)

    def _schedule_inputs(
        self, micro_batches: list[Any]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, dict[str, torch.Tensor]]:
        """(args, target, kwargs) of a schedule call: the micro-batches concatenated along the
        batch dimension (torch splits them back); tokens on the first stage only, labels on
        the last only, positions and doc ids (when every micro-batch has them) everywhere."""
        if len(micro_batches) != self.plan.grad_accum:
            raise ValueError(
                f"the pipeline was built for plan.grad_accum = {self.plan.grad_accum} "
                f"micro-batches, got {len(micro_batches)}"
            )
        _check_one_shape(micro_batches)
        kwargs = {}
        for name in ("positions", "doc_ids"):
            values = [getattr(mb, name, None) for mb in micro_batches]
            if all(v is not None for v in values):
                kwargs[name] = self._cat(values)
        offsets = [getattr(mb, "cu_seqlens", None) for mb in micro_batches]
        self._host_offsets = offsets if all(o is not None for o in offsets) else None
        if self._host_offsets is not None:  # row numbers: torch splits them with the rows
            kwargs[ROWS] = torch.arange(sum(mb.tokens.shape[0] for mb in micro_batches))
        args = (self._cat([mb.tokens for mb in micro_batches]),) if self.has_first else ()
        target = self._cat([mb.labels for mb in micro_batches]) if self.has_last else None
        return args, target, kwargs

    def _with_host_offsets(self, chunk: nn.Module, args: tuple, kwargs: dict):
        """A chunk's forward pre-hook: the micro-batch's host document offsets as the model's
        `cu_seqlens`, so no stage reads doc ids back. Which micro-batch this is comes from its
        share of the `ROWS` numbers torch split off (a view: its storage offset is its first
        row, metadata only); torch's shape inference passes them on the meta device."""
        rows = kwargs.pop(ROWS, None)
        if rows is not None and rows.device.type == "cpu" and self._host_offsets is not None:
            kwargs["cu_seqlens"] = self._host_offsets[rows.storage_offset() // rows.shape[0]]
        return args, kwargs

    def _reshard(self) -> None:
        """Free every gathered FSDP unit (a no-op for units already sharded)."""
        for unit in self._fsdp_units:
            unit.reshard()

    def _cat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors, dim=0).to(self.device)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


ROWS = "pipeline_rows"  # the stage kwarg naming a micro-batch's rows (`_host_offsets`)


def _check_one_shape(micro_batches: list[Any]) -> None:
    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    if len(shapes) > 1:
        raise ValueError(f"pipeline micro-batches must share one shape, got {sorted(shapes)}")


def _rounds(micro_batches: list[Any], per_round: int) -> list[list[Any]]:
    """`micro_batches` in groups of `per_round`, the last one filled up with copies of the
    first micro-batch whose labels are all -100 (they add no loss and no tokens)."""
    rounds = [
        list(micro_batches[i : i + per_round]) for i in range(0, len(micro_batches), per_round)
    ]
    if rounds and len(rounds[-1]) < per_round:
        first = micro_batches[0]
        filler = SimpleNamespace(
            tokens=first.tokens,
            labels=torch.full_like(first.labels, IGNORE_INDEX),
            positions=getattr(first, "positions", None),
            doc_ids=getattr(first, "doc_ids", None),
        )
        rounds[-1] += [filler] * (per_round - len(rounds[-1]))
    return rounds
