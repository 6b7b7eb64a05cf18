"""Tied embeddings across pipeline stages: the first stage's `tok_embeddings.weight` and the last
stage's `output.weight` are two copies of one matrix [vocab, hidden], kept equal.

- Equal at start: both copies are drawn under the embedding's name
  (`fivefold.model.transformer.init_aliases`), element by global index, so they match each
  other and the single-process model in any sharding.
- Equal after every step: `TiedEmbeddings.sum_grads` sums the copies' gradients before the
  gradient norm and the optimizer (Megatron's embedding group). The ranks holding the first and
  the last stage at the same (dp, cp, tp) coordinate all-reduce over a group of their own; under
  ZeRO/FSDP2 or TP a copy is a DTensor shard, and both copies are sharded alike (same mesh, same
  placements), so summing the local shards sums the matrix. V-shaped schedules (zbv, dualpipev)
  put both ends on pipeline rank 0: the copies are summed locally, with no collective. Given
  equal values, gradients and optimizer states, any optimizer moves both copies alike.
- The gradient norm counts the matrix once (`norm_excluded`: the last stage's copy is left out).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.specs.geometry import axis_groups, chunk_rank
from fivefold.specs.plan import ParallelPlan


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _embedding_group(plan: ParallelPlan) -> dist.ProcessGroup | None:
    """This rank's group of the ranks holding the first and the last stage at its (dp, cp, tp)
    coordinate (None when both stages sit on one pipeline rank). Collective over the world:
    every rank creates every group. Pipeline rank r's ranks are r * stride + i, i < stride
    (pp is the outermost mesh axis, `fivefold.specs.geometry.axis_groups`); arithmetic, not the
    mesh's rank tensor, so that it also runs under `fivefold plan check`'s fake tensors."""
    first = chunk_rank(plan.schedule, plan.pp, 0)
    last = chunk_rank(plan.schedule, plan.pp, plan.pp * plan.vpp - 1)
    if first == last:
        return None
    stride = axis_groups(plan)["pp"][1]
    pairs = [[first * stride + i, last * stride + i] for i in range(stride)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


class TiedEmbeddings:
    """The copies of the tied matrix on this rank's chunks and how to keep them equal.

    `chunks`: this rank's pipeline chunks (with `stage_index`). Construct on every rank
    (collective: creates the groups).
    """

    def __init__(self, chunks: list[nn.Module], plan: ParallelPlan, spec) -> None:
        self.active = bool(spec.tied_embeddings) and plan.pp > 1
        self.copies: list[nn.Parameter] = []
        self._last_copies: list[nn.Parameter] = []
        self.group = _embedding_group(plan) if self.active else None
        if not self.active:
            return
        last = plan.pp * plan.vpp - 1
        for chunk in chunks:
            if chunk.stage_index == 0:
                self.copies.append(chunk.tok_embeddings.weight)
            if chunk.stage_index == last:
                self.copies.append(chunk.output.weight)
                self._last_copies.append(chunk.output.weight)
        self._check_alike()

    def _check_alike(self) -> None:
        if len(self.copies) == 2:
            a, b = self.copies
            assert a.shape == b.shape and type(a) is type(b), "tied copies differ"
            if isinstance(a, DTensor):
                assert a.placements == b.placements, "tied copies are sharded differently"

    def norm_excluded(self) -> set[int]:
        """ids of the parameters the gradient norm leaves out (the last stage's copy)."""
        return {id(p) for p in self._last_copies}

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Replace every copy's gradient by the sum over all copies (after the backward, before
        the norm and the optimizer). Collective over the embedding group."""
        if not self.copies:
            return
        grads = [_local(p.grad) if p.grad is not None else None for p in self.copies]
        present = [g for g in grads if g is not None]
        like = _local(self.copies[0])
        total = torch.zeros_like(like) if not present else present[0].clone()
        for grad in present[1:]:
            total += grad
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for param, grad in zip(self.copies, grads, strict=True):
            if grad is None:
                param.grad = _as_grad(param, total.clone())
            else:
                grad.copy_(total)


def _as_grad(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` from its local values (a DTensor like `param` if it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local
