"""Sequence parallelism's gathered inputs kept as their 1/tp shard for the backward.

Under TP+SP each block all-gathers its attention and MLP inputs [b, s/tp, h] -> [b, s, h]
(the modules' `PrepareModuleInput`, Shard(1) -> Replicate()); the column-parallel linears
reading them save the gathered tensor for their weight gradients. Megatron keeps the sequence
shard instead and all-gathers again in the backward; this module does the same with
`torch.autograd.graph.saved_tensors_hooks` (the documented hook for changing how autograd
stores a tensor): inside the module's forward, a saved tensor aliasing the gathered input is
packed as its geometry (size, stride, offset) and the shard (already alive: the norm's
output), and unpacked by all-gathering the shard again, once per backward of the module (the
re-gathered tensor is shared by every reader: wq, wk, wv or w1, w3).

Applied to a block's `attention` and `feed_forward` after TP and before compile (a compiled
block decides its saved tensors itself: not applied) and skipped at run time inside a
fully recomputed block (its checkpoint stores only the block's input). Forward and backward
values are unchanged: the re-gathered tensor holds the same values.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_INSTALLED = "_fivefold_sp_regather"


class _Packed:
    """A saved tensor that aliases the gathered input: its view geometry, and the DTensor
    metadata when it was a DTensor."""

    __slots__ = ("holder", "offset", "size", "spec", "stride")

    def __init__(self, holder: _Regather, t: torch.Tensor, local: torch.Tensor) -> None:
        self.holder = holder
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()
        self.spec = (t.device_mesh, t.placements, t.size(), t.stride()) if t is not local else None


class _Regather:
    """One forward of one module: the shard input, the gathered input's storage, and the
    re-gathered local tensor [b, s, h] while backward readers remain."""

    def __init__(self, shard: DTensor, gathered: DTensor) -> None:
        self.shard = shard
        self.storage = gathered._local_tensor.untyped_storage()._cdata
        self.pending = 0
        self.full: torch.Tensor | None = None

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if _wrapped(local) or local.untyped_storage()._cdata != self.storage:
            return t
        self.pending += 1
        return _Packed(self, t, local)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if self.full is None:
            with torch.no_grad():
                self.full = self.shard.redistribute(placements=[Replicate()]).to_local()
        local = self.full.as_strided(packed.size, packed.stride, packed.offset)
        self.pending -= 1
        if self.pending == 0:
            self.full = None  # the last reader holds it until its gradient is computed
        if packed.spec is None:
            return local
        mesh, placements, size, stride = packed.spec
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=size, stride=stride
        )


def _wrapped(local: torch.Tensor) -> bool:
    """A tensor subclass holding other tensors (torchao's FP8 tensors): not re-gathered."""
    return is_traceable_wrapper_subclass(local)


def _sharded_input(x: Any) -> bool:
    return (
        isinstance(x, DTensor)
        and x.device_mesh.ndim == 1
        and tuple(x.placements) == (Shard(1),)
        and x.device_mesh.size() > 1
    )


def _regathered_forward(module: nn.Module, block: nn.Module, forward: Any, *args, **kwargs):
    shard = module.__dict__.pop("_fivefold_sp_shard", None)
    gathered = args[0] if args else None
    fully_recomputed = getattr(block, "_fivefold_recompute", False)
    plain = isinstance(gathered, DTensor) and not _wrapped(gathered._local_tensor)
    if shard is None or fully_recomputed or not plain:  # FP8 styles gather FP8: unchanged
        return forward(*args, **kwargs)
    state = _Regather(shard, gathered)
    with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
        return forward(*args, **kwargs)


def _keep_shard(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook, before the gather: remember the sequence shard [b, s/tp, h]."""
    if args and _sharded_input(args[0]) and torch.is_grad_enabled():
        module.__dict__["_fivefold_sp_shard"] = args[0]


def apply_sp_regather(block: nn.Module) -> int:
    """Keep the gathered inputs of `block`'s attention and dense MLP as their sequence shard
    (idempotent); returns how many modules it applied to."""
    applied = 0
    for name in ("attention", "feed_forward"):
        module = getattr(block, name, None)
        if module is None or getattr(module, _INSTALLED, False):
            continue
        module.register_forward_pre_hook(_keep_shard, prepend=True)
        module.forward = functools.partial(  # type: ignore[method-assign]
            _regathered_forward, module, block, module.forward
        )
        setattr(module, _INSTALLED, True)
        applied += 1
    return applied
