"""Deterministic, layout-independent weight initialisation, computed shard by shard.

Details: docs/internals.md (`fivefold.model.init`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fivefold.model.norms import RMSNorm

INIT_STD = 0.02
BLOCK_ELEMENTS = 1 << 18  # 1 MiB of fp32 drawn at a time
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_RESIDUAL_OUTPUT_SUFFIXES = ("attention.wo.weight", ".w2.weight", "experts.w2")


def canonical_fqn(name: str) -> str:
    """Parameter name with wrapper prefixes (activation checkpointing, compile) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, fqn: str, block: int = 0) -> int:
    """A 63-bit generator seed from (seed, FQN, row block), stable across processes and Python
    versions. Block 0 keeps the parameter's own seed, so a parameter that fits in one block has
    the values it had when parameters were drawn whole."""
    key = f"{seed}:{canonical_fqn(fqn)}" + (f":{block}" if block else "")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_per_block(columns: int) -> int:
    """Rows of the [R, C] view drawn by one generator (depends on the shape only)."""
    return max(1, BLOCK_ELEMENTS // max(1, columns))


def init_std(fqn: str, layers: int) -> float:
    """The normal std of a (non-norm) weight."""
    if canonical_fqn(fqn).endswith(_RESIDUAL_OUTPUT_SUFFIXES):
        return INIT_STD / math.sqrt(2 * layers)
    return INIT_STD


def _global_rows(shape: Sequence[int], indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row numbers in the [R, C] view of the local shard's rows, in local order: [local R]."""
    rows = torch.zeros(1, dtype=torch.long)
    for size, index in zip(shape[:-1], indices[:-1], strict=True):
        rows = (rows[:, None] * size + index[None, :]).flatten()
    return rows


@torch.no_grad()
def fill_normal_shard(
    out: torch.Tensor,
    fqn: str,
    shape: Sequence[int],
    indices: Sequence[torch.Tensor],
    seed: int,
    std: float,
) -> None:
    """Write into `out` the elements of the (seed, fqn) normal tensor of global `shape` whose
    global index along dim k is in `indices[k]` (LongTensor, in local order): `out` has shape
    [len(i) for i in indices]. Draws on CPU in fp32, then casts to `out`'s dtype and device."""
    if len(shape) == 0:
        shape, indices, out = (1,), (torch.zeros(1, dtype=torch.long),), out.view(1)
    columns = shape[-1]
    total_rows = math.prod(shape[:-1])
    block_rows = rows_per_block(columns)
    rows = _global_rows(shape, indices)  # [r]
    cols = indices[-1]
    all_cols = cols.numel() == columns and bool((cols == torch.arange(columns)).all())
    target = (
        out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    )
    local = target.view(rows.numel(), cols.numel())
    blocks = rows // block_rows
    for block in torch.unique(blocks).tolist():
        first = block * block_rows
        count = min(block_rows, total_rows - first)
        generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn, block))
        values = torch.empty(count, columns).normal_(0.0, std, generator=generator)
        positions = torch.nonzero(blocks == block).flatten()  # local rows in this block
        picked = values.index_select(0, rows[positions] - first)
        if not all_cols:
            picked = picked.index_select(1, cols)
        local.index_copy_(0, positions.to(out.device), picked.to(out.device, out.dtype))
    if target is not out:
        out.copy_(target)


def shard_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """For each dim of `param`'s global shape, the global indices of its local elements (local
    order). A plain tensor holds everything; a DTensor's are read from its own placements by
    sharding a small index tensor the same way (`distribute_tensor`, no communication)."""
    # here: torch.distributed.tensor takes ~2 s to import, and a one-process run never needs it
    from torch.distributed.tensor import DTensor, distribute_tensor

    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return [torch.arange(size) for size in shape]
    mesh, placements = param.device_mesh, param.placements
    # Dims sharded on any mesh dim get a proxy length that every split leaves non-empty.
    split = [1] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard() or hasattr(placement, "split_factor"):
            split[placement.dim] *= mesh.size(mesh_dim) * getattr(placement, "split_factor", 1)
    indices = []
    for dim, size in enumerate(shape):
        proxy_shape = [split[d] if d != dim else size for d in range(len(shape))]
        view = [1] * len(shape)
        view[dim] = size
        proxy = torch.arange(size, device=mesh.device_type).view(view).expand(proxy_shape)
        local = distribute_tensor(
            proxy.contiguous(), mesh, placements, src_data_rank=None
        ).to_local()
        take = [0] * len(shape)
        take[dim] = slice(None)
        indices.append(
            local[tuple(take)].cpu() if local.numel() else torch.zeros(0, dtype=torch.long)
        )
    return indices


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # here: as in `shard_indices`

    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def init_parameter(param: torch.Tensor, fqn: str, is_norm: bool, seed: int, layers: int) -> None:
    """Initialise `param` (plain or DTensor; only the local shard is touched) in place: a norm's
    weight to ones, a bias to zeros, any other weight normal (`init_std`)."""
    local = _local(param)
    if is_norm:
        local.fill_(1.0)
        return
    if canonical_fqn(fqn).endswith(".bias"):
        local.zero_()
        return
    if local.numel() == 0:
        return
    indices = shard_indices(param)
    fill_normal_shard(local, fqn, param.shape, indices, seed, init_std(fqn, layers))


@torch.no_grad()
def init_module_weights(
    module: nn.Module,
    seed: int,
    layers: int,
    prefix: str = "",
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Initialise every parameter of `module` (materialised, e.g. after `to_empty`).

    `prefix` is the module's FQN inside the full Transformer ("" for the Transformer itself,
    e.g. "layers.3." for one block), `layers` the full model's number of layers. `aliases` maps
    an FQN to the one whose values it must share (a tied LM head on its own pipeline stage).
    Parameters may be DTensors: each rank fills its own shard (see the module docstring).
    Buffers start at zero.
    """
    aliases = aliases or {}
    seen: set[int] = set()  # a tied weight is drawn once, under its first FQN
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            fqn = prefix + (f"{module_name}.{param_name}" if module_name else param_name)
            fqn = aliases.get(canonical_fqn(fqn), fqn)
            init_parameter(param, fqn, isinstance(sub, RMSNorm), seed, layers)
    for buffer in module.buffers():  # the routers' score-correction biases and load counts
        buffer.zero_()
