"""Tensor parallelism (Megatron-style) with sequence parallelism, on DTensor parallel styles.

Details: docs/internals.md (`fivefold.parallel.tensor_parallel`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.nn.utils.stateless import _reparametrize_module

from fivefold.model.latent_attention import LatentAttention
from fivefold.parallel.float8 import float8_tp_styles, is_float8_linear
from fivefold.specs.model import ModelSpec


class ReplicatedKVColwise(ParallelStyle):
    """Column-parallel key/value projection when tp > kv_heads (kv heads replicated).

    The weight [Hkv * Dh, D] (and a bias [Hkv * Dh]) is placed on a 2-D view (kv, rep) of the
    TP mesh as [Shard(0), Replicate()]: TP rank r holds kv head r // (tp / Hkv), which is the
    head read by its query heads [r * Hq/tp, (r+1) * Hq/tp). Forward: input [B, T, D]
    (replicated DTensor on the TP mesh) -> local output [B, T, Dh], a plain matmul with the
    local weight. Backward: each rank's gradients cover only its own query heads, so the weight
    gradient is a partial sum over the `rep` ranks of its head (reduced with the other
    gradients by FSDP/DDP) and the input gradient a partial sum over the TP group (reduced once,
    with the other projections', where the attention input is gathered).
    """

    def __init__(self, kv_mesh: DeviceMesh):
        super().__init__()
        self.kv_mesh = kv_mesh
        self.src_data_rank = None

    def _partition(self, module: nn.Linear) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(
                param, self.kv_mesh, [Shard(0), Replicate()], src_data_rank=None
            )
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))

    @staticmethod
    def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
        weight, bias = (
            None if p is None else p.to_local(grad_placements=[Shard(0), Partial()])
            for p in (module.weight, module.bias)
        )
        return F.linear(x, weight, bias)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or is_float8_linear(module):
            # FP8 key/value projections with tp > kv_heads are refused by the plan's rules
            # (`ParallelPlan.runtime_problems`): this forward is a plain matmul.
            raise NotImplementedError("ReplicatedKVColwise shards high-precision nn.Linear only")
        self._partition(module)
        module.forward = partial(self._forward, module)  # type: ignore[method-assign]
        return module


class VocabParallelEmbedding(ParallelStyle):
    """The token embedding sharded over the vocabulary and looked up on the local rows, as
    Megatron's VocabParallelEmbedding does.

    The weight [V, D] is a Shard(0) DTensor (as `RowwiseParallel` places it): TP rank r holds
    rows [r c, r c + c), c = ceil(V / tp). Forward: token ids [B, T] (plain, the same on every
    TP rank) -> each rank's rows for the ids it holds, zeros for the others, a Partial()
    [B, T, D] summed into `output_layout` (reduce-scattered along the sequence under SP,
    all-reduced without). Backward: the output gradient all-gathered to [B, T, D], the weight
    gradient made on the local rows, a Shard(0) [V/tp, D]. DTensor's rule for
    `embedding_dense_backward` (which `RowwiseParallel` takes) has no vocabulary-sharded
    output: its weight gradient is a Partial() [V, D] on every rank, which stays that size
    while gradients accumulate across micro-batches (fp32 under FSDP2's reduce dtype) and is
    reduce-scattered over TP only when the data-parallel reduction reads it.
    """

    def __init__(self, output_layout: Shard | Replicate) -> None:
        super().__init__()
        self.output_layout = output_layout
        self.src_data_rank = None

    @staticmethod
    def _forward(
        module: nn.Embedding, mesh: DeviceMesh, layout, start: int, ids: torch.Tensor
    ) -> torch.Tensor:
        weight = module.weight.to_local()  # [<= c, D]: its gradient is the Shard(0) one
        outside = (ids < start) | (ids >= start + weight.shape[0])  # [B, T]
        rows = F.embedding((ids - start).masked_fill(outside, 0), weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # [B, T, D], this rank's share
        summed = DTensor.from_local(rows, mesh, [Partial()], run_check=False)
        return summed.redistribute(mesh, [layout]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None:
            raise NotImplementedError("VocabParallelEmbedding shards a plain nn.Embedding")
        placed = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter("weight", nn.Parameter(placed, module.weight.requires_grad))
        chunk = -(-module.num_embeddings // device_mesh.size())  # torch.chunk's rows per rank
        start = device_mesh.get_local_rank() * chunk
        forward = partial(self._forward, module, device_mesh, self.output_layout, start)
        module.forward = forward  # type: ignore[method-assign]
        return module


class ReplicatedOwnTokens(ParallelStyle):
    """A module whose parameters are replicated over the TP group while each rank computes on
    its own tokens (a MoE's router under tensor parallelism).

    Every parameter becomes a Replicate() DTensor on the TP mesh; the forward runs the module's
    own code on the local values, so inputs and outputs stay plain tensors. Backward: each
    rank's parameter gradient covers its own tokens only, a partial sum over the TP group
    (reduced with the other gradients by FSDP/DDP, which bring it to Replicate()).
    """

    def __init__(self) -> None:
        super().__init__()
        self.src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                placed = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
                owner.register_parameter(name, nn.Parameter(placed, param.requires_grad))
        forward = module.forward

        def local_forward(*args, **kwargs):
            local = {
                name: p.to_local(grad_placements=[Partial()])
                for name, p in module.named_parameters()
            }
            with _reparametrize_module(module, local):
                return forward(*args, **kwargs)

        module.forward = local_forward  # type: ignore[method-assign]
        return module


def _moe_plan(moe: nn.Module, sp: bool, styles: _Styles) -> dict[str, ParallelStyle]:
    """A MoE layer under TP (docs/internals.md, "MoE with tensor parallelism"): its input
    [B, T, D] is split over the TP ranks along the sequence (already so under SP; a local slice
    otherwise, whose gradient is all-gathered), so each rank routes and dispatches its own
    T/tp tokens and its output [B, T/tp, D] is the block's sequence shard (all-gathered back to
    the replicated stream without SP). The router is replicated (`ReplicatedOwnTokens`), the
    routed experts whole (expert parallelism places them), the shared experts tensor-parallel
    like a dense MLP over the TP group's tokens: their input [N/tp, D] all-gathered, their
    output reduce-scattered back to [N/tp, D]."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        ),
        "moe.router": ReplicatedOwnTokens(),
    }
    shared = moe.shared_expert
    if shared is not None:
        up = ("moe.shared_expert.w1",) + (("moe.shared_expert.w3",) * (shared.w3 is not None))
        plan["moe.shared_expert"] = styles.inputs(up, (Shard(0),), (Replicate(),))
        for fqn in up:
            plan[fqn] = styles.col(fqn)
        plan["moe.shared_expert.w2"] = styles.row("moe.shared_expert.w2", Shard(0))
    return plan


class ReplicateParallel(ParallelStyle):
    """A small module every TP rank computes whole on DTensors: its parameters replicated over
    the TP group, its input and output replicated DTensors (MLA's down projections and their
    norms). The column-parallel projections reading its output return partial input gradients
    (each rank's heads); DTensor sums them where the gradient needs the whole (the norms'
    backward), so the weights' gradients are sums over every head, as in one process."""

    def __init__(self) -> None:
        super().__init__()
        self.src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        return module


def _latent_attention_plan(
    attention: LatentAttention, styles: _Styles, seq
) -> dict[str, ParallelStyle]:
    """MLA: the per-head projections (wq or wq_b, wkv_b) column-parallel and wo row-parallel,
    split by heads; the down projections wq_a and wkv_a and the latent norms replicated (their
    outputs, a few hundred wide, feed every head; the norms need the whole latent), as
    Megatron and torchtitan place them. The input is gathered in high precision (the replicated
    down projections read it)."""
    plan: dict[str, ParallelStyle] = {
        "attention": styles.inputs((), (seq, None, None), (Replicate(), None, None)),
        "attention.wkv_a": ReplicateParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": styles.col("attention.wkv_b"),
        "attention.wo": styles.row("attention.wo", seq),
    }
    if attention.wq is not None:
        return plan | {"attention.wq": styles.col("attention.wq")}
    return plan | {
        "attention.wq_a": ReplicateParallel(),
        "attention.q_norm": ReplicateParallel(),
        "attention.wq_b": styles.col("attention.wq_b"),
    }


def _gqa_plan(block: nn.Module, styles: _Styles, seq, kv_mesh: DeviceMesh | None):
    """Q, K, V column-parallel by heads (K and V replicated when tp > kv_heads), O row-parallel,
    QK-norm weights replicated."""
    qkv = ("attention.wq", "attention.wk", "attention.wv") if kv_mesh is None else ()
    plan: dict[str, ParallelStyle] = {
        "attention": styles.inputs(qkv, (seq, None, None), (Replicate(), None, None)),
        "attention.wq": styles.col("attention.wq"),
        "attention.wk": ReplicatedKVColwise(kv_mesh) if kv_mesh else styles.col("attention.wk"),
        "attention.wv": ReplicatedKVColwise(kv_mesh) if kv_mesh else styles.col("attention.wv"),
        "attention.wo": styles.row("attention.wo", seq),
    }
    if block.attention.q_norm is not None:
        # QK-norm: each rank normalises its own heads (dim 2 of [B, T, H, Dh]) with the
        # replicated weight [Dh], whose gradient is then a partial sum over the TP group
        # (reduced with the other gradients). Keys replicated over ranks (tp > kv_heads) are
        # normalised alike: each rank's key gradient comes from its own query heads only.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def kv_mesh_for(tp_mesh: DeviceMesh, kv_heads: int) -> DeviceMesh | None:
    """The (kv, rep) view of the TP mesh when tp > kv_heads, else None."""
    tp = tp_mesh.size()
    if tp <= kv_heads:
        return None
    return tp_mesh._unflatten(0, (kv_heads, tp // kv_heads), ("tp_kv", "tp_kv_rep"))


class _Styles:
    """The TP style of each linear of a block: torchao's float8 styles for the tensorwise
    Float8Linear (`plan.fp8`, `fivefold.parallel.float8.float8_tp_styles`), DTensor's for the
    rest; a module's input is cast to FP8 before its all-gather when every linear reading it
    is a Float8Linear sharded by those styles."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.fp8 = any(is_float8_linear(m) for m in block.modules())
        if self.fp8:
            self.colwise, self.rowwise, self.prepare = float8_tp_styles()

    def _float8(self, *fqns: str) -> bool:
        return self.fp8 and all(is_float8_linear(self.block.get_submodule(f)) for f in fqns)

    def col(self, fqn: str) -> ParallelStyle:
        return self.colwise() if self._float8(fqn) else ColwiseParallel()

    def row(self, fqn: str, output_layouts) -> ParallelStyle:
        style = self.rowwise if self._float8(fqn) else RowwiseParallel
        return style(output_layouts=output_layouts)

    def inputs(self, readers: tuple[str, ...], layouts: tuple, desired: tuple) -> ParallelStyle:
        style = self.prepare if readers and self._float8(*readers) else PrepareModuleInput
        return style(input_layouts=layouts, desired_input_layouts=desired)


def _block_plan(block: nn.Module, sp: bool, kv_mesh: DeviceMesh | None) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sp else Replicate()
    styles = _Styles(block)
    dense = block.feed_forward
    mlp = (
        ()
        if dense is None
        else ("feed_forward.w1",) + (("feed_forward.w3",) * (dense.w3 is not None))
    )
    if isinstance(block.attention, LatentAttention):
        plan = _latent_attention_plan(block.attention, styles, seq)
    else:
        plan = _gqa_plan(block, styles, seq, kv_mesh)
    for fqn in mlp:
        plan[fqn] = styles.col(fqn)
    if block.moe is not None:
        plan.update(_moe_plan(block.moe, sp, styles))
    else:
        plan["feed_forward"] = styles.inputs(mlp, (seq,), (Replicate(),))
        plan["feed_forward.w2"] = styles.row("feed_forward.w2", seq)
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, spec: ModelSpec, sequence_parallel: bool
) -> None:
    """Shard `model` (a Transformer or a pipeline chunk of one) over `tp_mesh` in place.

    Parameters must still be on the meta device or hold their full values (each rank then keeps
    its slice without communication). The LM head's output is a vocab-sharded DTensor: compute
    the loss inside `torch.distributed.tensor.parallel.loss_parallel()`.
    """
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = VocabParallelEmbedding(seq)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    parallelize = partial(parallelize_module, device_mesh=tp_mesh, src_data_rank=None)
    if top:
        parallelize(model, parallelize_plan=top)
    kv_mesh = kv_mesh_for(tp_mesh, spec.kv_heads)
    for block in model.layers.values():
        parallelize(block, parallelize_plan=_block_plan(block, sp, kv_mesh))
